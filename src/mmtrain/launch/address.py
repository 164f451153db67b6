"""`python -m mmtrain.launch.address [PEER] | --free-port`: facts a node finds out about itself.

- No argument: the IPv4 address other hosts reach this one at (the source address of its
  default route), for the head node of a job to host the rendezvous on. A scheduler's node
  names (`scontrol show hostnames`) need not resolve anywhere, so the address is found on the
  node itself rather than looked up by name.
- PEER: the address this host uses to reach PEER (the source address the kernel picks for it),
  which is the address torchrun's `--local-addr` must name so that the others can reach back.
- `--free-port`: a TCP port free on this host now, for the rendezvous.
- `--interface ADDRESS`: the name of the network interface holding ADDRESS, for
  GLOO_SOCKET_IFNAME: gloo otherwise binds to the address its host name resolves to, which on
  many hosts (and in every network namespace) is 127.0.0.1, unreachable from the other nodes.

No packets are sent: a UDP socket's `connect` only asks the kernel for a route.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys

# A documentation address (TEST-NET-3, RFC 5737): never answered, only routed by default.
_OUTSIDE = "203.0.113.1"


def route_source(peer: str = _OUTSIDE) -> str:
    """The local IPv4 address the kernel would send from to reach `peer`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def reachable_address() -> str:
    """This host's address for others: its default route's source, else a non-loopback address
    of its name; raises OSError when it has neither."""
    try:
        return route_source()
    except OSError:
        pass
    for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
        address = info[4][0]
        if not address.startswith("127."):
            return address
    raise OSError(
        "this host has no default route and its name resolves only to loopback: "
        "give the rendezvous address explicitly (mmtrain launch local --rdzv-host)"
    )


_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address


def interface_of(address: str) -> str | None:
    """The name of the interface whose IPv4 address is `address`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    try:
        if argv == ["--free-port"]:
            print(free_port())
        elif len(argv) == 2 and argv[0] == "--interface":
            name = interface_of(argv[1])
            if name is None:
                print(f"mmtrain.launch.address: no interface holds {argv[1]}", file=sys.stderr)
                return 1
            print(name)
        elif len(argv) == 1:
            print(route_source(argv[0]))
        elif not argv:
            print(reachable_address())
        else:
            print(
                "usage: python -m mmtrain.launch.address [PEER | --free-port | --interface ADDRESS]",
                file=sys.stderr,
            )
            return 2
    except OSError as err:
        print(f"mmtrain.launch.address: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
