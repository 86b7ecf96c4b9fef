"""How tests that start process groups or trainers meet their ranks without a fixed port, so that tests run at once
under pytest -n 2 never share one: free TCP ports, torchrun's own pick, or a file store."""
import socket
import sys


def free_port() -> int:
    """A port that is free now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_pair() -> int:
    """A free port whose successor is free too, for a script that takes a base port and uses the next one as well."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def launcher(nproc: int) -> list:
    """The command prefix that runs a script on `nproc` ranks: torchrun --standalone, whose rendezvous binds a port
    the OS picks at bind time (a port picked by free_port() first could be taken, by any process, before torchrun
    bound it: EADDRINUSE); plain python for one rank."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def init_gloo(rank: int, world: int, store: str) -> None:
    """A gloo process group whose ranks meet through the file `store` (a path that does not exist yet, the same on
    every rank): no TCP port to race for."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
