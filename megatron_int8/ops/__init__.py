"""Operations with a PyTorch reference and a Triton path (kernels/), chosen by the device."""
