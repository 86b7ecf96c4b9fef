"""Free TCP ports on localhost for the tests that start process groups or trainers (one place, so that tests run
at once under pytest -n 2 never share a fixed port)."""
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
