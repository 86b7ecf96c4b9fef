"""megatron-core integration: what plugs this package's ops into megatron's modules and optimizers."""
