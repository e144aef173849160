"""A real Redis Sentinel deployment on loopback for tests: a primary, a replica and three
sentinels (`redis-server --sentinel`, the binary Debian ships; there is no redis-sentinel one),
each on a free port, with short failure detection so a failover takes a few seconds.

    with SentinelCluster(tmp_path) as cluster:
        url = cluster.url()                      # redis+sentinel://127.0.0.1:p1,.../mymaster/0
        cluster.kill_primary()                   # SIGKILL; the sentinels promote the replica
        cluster.wait_failover(old)               # until they name another primary
        cluster.restart_as_replica(old)          # the old one comes back as the new one's replica
        cluster.cut_replication(replica)         # the replica falls behind (its link cut for good)
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from pipeline.store.local_redis import PortTaken, check_own_port, free_port, stop_process, wait_for_pong

SERVICE = "mymaster"
DOWN_AFTER_MS = 1000  # a primary silent this long is subjectively down
FAILOVER_TIMEOUT_MS = 3000


class Node:
    """One redis-server (a data node or a sentinel) on a fixed port in its own directory."""

    def __init__(self, root: Path, name: str, args: list[str], port: int | None = None):
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name, self.port, self.args = name, port or free_port(), args
        self.proc: subprocess.Popen | None = None

    def start(self, extra: list[str] | None = None) -> Node:
        binary = shutil.which("redis-server")
        assert binary, "redis-server not on PATH"
        self.proc = subprocess.Popen([binary, *self.argv(extra or [])], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, cwd=self.dir)
        wait_for_pong(self.port, self.proc, self.log_tail, what=self.name)
        # a sentinel whose port another server holds would leave the deployment a sentinel short:
        # discovery never completes
        check_own_port(self.port, self.proc, self.name)
        return self

    def argv(self, extra: list[str]) -> list[str]:
        return ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--logfile", str(self.dir / "log"), *self.args, *extra]

    def log_tail(self) -> str:
        log = self.dir / "log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is not None:
            stop_process(self.proc, kill=kill, grace_s=5)
        self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def distinct_free_ports(count: int) -> list[int]:
    """`count` ports free now and different from each other (held open together while picked:
    `free_port` twice in a row may name the same port)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SentinelNode(Node):
    def __init__(self, root: Path, name: str, primary_port: int, port: int):
        super().__init__(root, name, [], port)
        self.conf = self.dir / "sentinel.conf"
        self.conf.write_text("\n".join([
            f"port {self.port}", "bind 127.0.0.1", f"dir {self.dir}", f"logfile {self.dir / 'log'}",
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2",
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {SERVICE} 1", "",
        ]))

    def argv(self, extra: list[str]) -> list[str]:
        return [str(self.conf), "--sentinel", *extra]


def command(port: int, *args: str, timeout: float = 2.0) -> str:
    """One command to a local server over RESP; the reply's raw text (enough for INFO and SENTINEL)."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        time.sleep(0.02)
        data = b""
        s.settimeout(0.2)
        try:
            while chunk := s.recv(65536):
                data += chunk
        except TimeoutError:
            pass
    return data.decode(errors="replace")


class SentinelCluster:
    """Two data nodes (primary + replica) and three sentinels watching them."""

    def __init__(self, root: Path):
        self.failovers = 0
        self._place(root)

    def _place(self, root: Path) -> None:
        """New nodes and sentinels under `root`, each on a port free now."""
        self.root = root
        node_args = ["--save", "", "--appendonly", "no", "--repl-diskless-sync", "yes",
                     "--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1"]
        ports = distinct_free_ports(5)
        self.nodes = [Node(root, "a", node_args, ports[0]), Node(root, "b", node_args, ports[1])]
        self.sentinels = [SentinelNode(root, f"s{i}", ports[0], ports[2 + i]) for i in range(3)]

    def start(self) -> SentinelCluster:
        try:
            return self._form()
        except (TimeoutError, PortTaken) as stalled:
            # Discovery takes ~3 s here (hellos every 2 s); one CI run saw it stall for 30 s with
            # no trace (two sentinels on one port would do that: `Node.start` now checks). The
            # deployment, not the code under test, failed to form: print what each sentinel knew
            # and form a fresh one (new ports and directories), once; a second failure is raised.
            print(f"sentinel cluster did not form, forming a fresh one: {stalled}")
            self.close()
            self._place(self.root.with_name(self.root.name + "-again"))
            return self._form()

    def _form(self) -> SentinelCluster:
        a, b = self.nodes
        a.start()
        b.start(["--replicaof", "127.0.0.1", str(a.port)])
        self.wait_synced()
        for s in self.sentinels:
            s.start()
        self.wait_watched()
        return self

    def url(self, db: int = 0, *, min_replica_acks: int | None = None) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        query = "" if min_replica_acks is None else f"?min_replica_acks={min_replica_acks}"
        return f"redis+sentinel://{hosts}/{SERVICE}/{db}{query}"

    def primary_port(self) -> int | None:
        """The primary's port as the first sentinel that answers names it."""
        for s in self.sentinels:
            if not s.alive:
                continue
            try:
                reply = command(s.port, "SENTINEL", "get-master-addr-by-name", SERVICE)
            except OSError:
                continue
            parts = reply.split("\r\n")
            if len(parts) >= 5:
                return int(parts[4])
        return None

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def primary(self) -> Node:
        port = self.primary_port()
        assert port is not None, "no sentinel names a primary"
        return self.node(port)

    def replica_of(self, primary: Node) -> Node:
        return next(n for n in self.nodes if n is not primary)

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Until the replica's link is up and it has the primary's whole replication stream."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            primary = self.primary() if any(s.alive for s in self.sentinels) else self.nodes[0]
            replica = self.replica_of(primary)
            if replica.alive and primary.alive:
                # the primary's offset first: a replica in sync has reached it by the time it is asked
                offset = _field(command(primary.port, "INFO", "replication"), "master_repl_offset")
                info = command(replica.port, "INFO", "replication")
                if "master_link_status:up" in info and _field(info, "slave_repl_offset") >= offset > 0:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"replica not in sync after {timeout}s")

    def wait_watched(self, timeout: float = 30.0) -> None:
        """Until every sentinel knows the replica and the other two sentinels (a failover needs them)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = True
            for s in self.sentinels:
                reply = command(s.port, "SENTINEL", "master", SERVICE)
                ok &= _sentinel_field(reply, "num-slaves") >= 1
                ok &= _sentinel_field(reply, "num-other-sentinels") >= 2
            if ok:
                return
            time.sleep(0.1)
        raise TimeoutError(f"sentinels did not discover each other and the replica in {timeout}s:\n{self.describe()}")

    def describe(self) -> str:
        """What each sentinel knows of the service, and its log's tail (for a failure's message)."""
        fields = ("ip", "port", "flags", "num-slaves", "num-other-sentinels", "link-pending-commands")
        parts = []
        for s in self.sentinels:
            try:
                reply = command(s.port, "SENTINEL", "master", SERVICE)
                known = {f: _sentinel_value(reply, f) for f in fields}
            except OSError as error:
                known = {"unreachable": repr(error)}
            parts.append(f"{s.name} :{s.port} alive={s.alive} {known}\n{s.log_tail()[-1200:]}")
        nodes = " ".join(f"{n.name} :{n.port} alive={n.alive}" for n in self.nodes)
        return f"nodes {nodes}\n" + "\n".join(parts)

    def kill_primary(self) -> Node:
        victim = self.primary()
        victim.stop(kill=True)
        return victim

    def wait_failover(self, old: Node, timeout: float = 30.0) -> Node:
        """Until a sentinel names another primary than `old`, and that node says it is one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = self.primary_port()
            if port is not None and port != old.port and "role:master" in command(port, "INFO", "replication"):
                self.failovers += 1
                return self.node(port)
            time.sleep(0.05)
        raise TimeoutError(f"no failover from port {old.port} in {timeout}s:\n{self.sentinels[0].log_tail()}")

    def cut_replication(self, replica: Node) -> None:
        """Cut the replica's link to the primary for good: its handshake's AUTH fails (a user that
        does not exist), so it falls behind while alive and answering the sentinels, which may still
        promote it (a link down for less than 10 x down-after). SIGSTOP would not do this: what the
        primary sent sits in the stopped replica's socket buffer and is applied when it resumes,
        after the primary's kill too. `mend_replication` undoes the settings."""
        command(replica.port, "CONFIG", "SET", "masteruser", "no-such-user", "masterauth", "cut")
        command(replica.port, "CLIENT", "KILL", "TYPE", "master")
        deadline = time.monotonic() + 5
        while "master_link_status:down" not in command(replica.port, "INFO", "replication"):
            assert time.monotonic() < deadline, "the replica's link did not go down"
            time.sleep(0.02)

    def mend_replication(self, node: Node) -> None:
        command(node.port, "CONFIG", "SET", "masteruser", "", "masterauth", "")

    def restart_as_replica(self, node: Node) -> None:
        """Start `node` again (empty: no persistence) as the replica of the current primary, as an
        operator (or the sentinels, once they see it) would."""
        primary = self.primary()
        node.start(["--replicaof", "127.0.0.1", str(primary.port)])

    def close(self) -> None:
        for s in self.sentinels:
            s.stop()
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> SentinelCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def _field(info: str, name: str) -> int:
    for line in info.split("\r\n"):
        if line.startswith(name + ":"):
            return int(line.split(":", 1)[1])
    return -1


def _sentinel_value(reply: str, name: str) -> str | None:
    """A field of a RESP flat array reply (`SENTINEL master`): the bulk string after `name`."""
    lines = reply.split("\r\n")
    for i, line in enumerate(lines):
        if line == name and i + 2 < len(lines):
            return lines[i + 2]
    return None


def _sentinel_field(reply: str, name: str) -> int:
    value = _sentinel_value(reply, name)
    try:
        return int(value) if value is not None else -1
    except ValueError:
        return -1
