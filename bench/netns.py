"""Network namespaces joined by veth pairs, for multi-node tests and benchmarks on one machine.

    with Net(["n0", "n1", "n2"], shape={"n2": "50mbit"}) as net:
        net.addr("n0")                      # "10.213.0.2"
        subprocess.Popen(net.argv("n0") + [sys.executable, ...])

One namespace per host plus one "switch" namespace holding a bridge; each host's namespace is joined
to the bridge by a veth pair and gets 10.213.0.<k + 2>/24 on its end. Nothing is added to the
namespace this process runs in (no address, no route, no sysctl): the hosts reach only each other.
`shape` puts a `tc tbf` qdisc on a host's outgoing side of its link (this kernel has tbf but no
netem, so delay and loss are not shaped here). Needs root and `ip`; available() says why not.
Every namespace and link is removed by close() (removing a namespace removes its veth ends).
"""
import os
import shutil
import subprocess

SUBNET = "10.213.0"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str:
    """'' when namespaces can be made here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` or `tc` (iproute2) is not installed"
    probe = f"shcprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


class Net:
    def __init__(self, hosts, shape=None, burst: str = "64kb"):
        self.tag = f"shc{os.getpid()}"
        self.hosts = list(hosts)
        self._made = []
        try:
            self._build(shape or {}, burst)
        except BaseException:
            self.close()
            raise

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 2}"

    def argv(self, host: str) -> list:
        """The command prefix that runs a program inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns(host)]

    def _add_ns(self, name):
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self, shape, burst):
        sw = f"{self.tag}-sw"
        self._add_ns(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for k, host in enumerate(self.hosts):
            ns = self.ns(host)
            self._add_ns(ns)
            port = f"p{k}"
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if host in shape:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                                "rate", shape[host], "burst", burst, "latency", "200ms"],
                               check=True, capture_output=True)

    def close(self):
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
