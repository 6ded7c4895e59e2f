"""A loopback Mooncake cluster: ``mooncake_master`` and an optional segment holder.

:func:`start_mooncake_master` starts the master bundled with the ``mooncake`` extra
(with its HTTP metadata server) on free ports, and with ``segment_nbytes`` a
``mooncake_client`` that lends memory to the pool, so pages outlive the processes
that write them; :class:`MooncakeMaster` is the running pair and its
``--storage`` spec for :class:`~hicache.storage.mooncake.MooncakeStorage`. Used by
the tests, the benchmarks and one-machine setups (docs/storage.md). It manages
processes only: nothing here reads or writes pages.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from hicache.storage.mooncake import INSTALL_HINT, port_open


def mooncake_binary(name: str) -> Path:
    """Path of a binary bundled in the mooncake package (``mooncake_master`` ...)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(INSTALL_HINT)
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise ImportError(f"{path} is missing; {INSTALL_HINT}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """A running ``mooncake_master`` (and optional segment holder) started by this process."""

    def __init__(
        self,
        host: str,
        rpc_port: int,
        metadata_port: int,
        master: subprocess.Popen,
        holder: subprocess.Popen | None,
        log_dir: Path,
        owns_log_dir: bool = False,
    ) -> None:
        self.host = host
        self.rpc_port = rpc_port
        self.metadata_port = metadata_port
        self.master = master
        self.holder = holder
        self.log_dir = log_dir
        self.owns_log_dir = owns_log_dir  # a temp dir made for us: removed by stop()
        self.num_restarts = 0
        self.master_command: list[str] = []  # how the master was started (restart_master)

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def spec(self) -> str:
        """The ``--storage`` spec that reaches this master."""
        return f"mooncake://{self.master_address}?metadata={self.metadata_url}"

    def kill_master(self) -> None:
        """SIGKILL the master only (simulates a crash); the holder is left running."""
        if self.master.poll() is None:
            self.master.send_signal(signal.SIGKILL)
            self.master.wait()

    def restart_master(self, startup_timeout_s: float = 20.0) -> None:
        """Start the master again on the same ports (after :meth:`kill_master`; killed
        first if still running). It starts empty: every object, and its metadata
        store, is gone; the holder and live clients reconnect to it by themselves."""
        self.kill_master()
        log_path = self.log_dir / f"master.{self.num_restarts + 1}.log"
        with open(log_path, "wb") as log:
            self.master = subprocess.Popen(self.master_command, stdout=log,
                                           stderr=subprocess.STDOUT)
        self.num_restarts += 1
        _wait_ready(self.master, self.host, [self.rpc_port, self.metadata_port], log_path,
                    time.monotonic() + startup_timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the holder, then the master; SIGKILL whatever ignores SIGTERM."""
        for proc in (self.holder, self.master):
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.owns_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_ready(
    proc: subprocess.Popen[bytes], host: str, ports: list[int], log: Path, deadline: float
) -> None:
    program = str(proc.args[0] if isinstance(proc.args, list) else proc.args)
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{program} exited with {proc.returncode}:\n{tail}")
        if all(port_open(host, p, 0.2) for p in ports):
            return
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{program} not listening on {host}:{ports}; see {log}")
        time.sleep(0.05)


def start_mooncake_master(
    *,
    host: str = "127.0.0.1",
    segment_nbytes: int = 0,
    log_dir: str | os.PathLike[str] | None = None,
    startup_timeout_s: float = 20.0,
    extra_args: tuple[str, ...] = (),
) -> MooncakeMaster:
    """Start ``mooncake_master`` on free ports of ``host`` with its HTTP metadata server.

    With ``segment_nbytes > 0`` also start a ``mooncake_client`` lending that much
    memory, so stored pages survive the clients that wrote them. Logs go to
    ``log_dir`` (by default a temp dir that ``stop()`` removes). Call ``stop()`` (or
    use ``with``).
    """
    master_bin = mooncake_binary("mooncake_master")
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="mooncake-"))
    logs.mkdir(parents=True, exist_ok=True)
    rpc_port, metadata_port, metrics_port = (_free_port(host) for _ in range(3))
    master_log = logs / "master.log"
    cmd = [
        str(master_bin),
        f"--rpc_address={host}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={metadata_port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
        "--logtostderr",
        *extra_args,
    ]
    deadline = time.monotonic() + startup_timeout_s
    with open(master_log, "wb") as log:
        master = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    _wait_ready(master, host, [rpc_port, metadata_port], master_log, deadline)
    handle = MooncakeMaster(host, rpc_port, metadata_port, master, None, logs, log_dir is None)
    handle.master_command = cmd
    if segment_nbytes > 0:
        holder_port = _free_port(host)
        holder_log = logs / "segment_holder.log"
        holder_cmd = [
            str(mooncake_binary("mooncake_client")),
            f"--host={host}",
            f"--port={holder_port}",
            f"--master_server_address={handle.master_address}",
            f"--metadata_server={handle.metadata_url}",
            f"--global_segment_size={segment_nbytes}",
            "--protocol=tcp",
        ]
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": host}
        with open(holder_log, "wb") as log:
            handle.holder = subprocess.Popen(
                holder_cmd, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        try:
            _wait_ready(handle.holder, host, [holder_port], holder_log, deadline)
        except RuntimeError:
            handle.stop()
            raise
    return handle
