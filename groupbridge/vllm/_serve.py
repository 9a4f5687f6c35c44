"""A ``vllm serve`` started here (``groupbridge.vllm.Server``: to try the backend on one machine; the tests,
the benchmark and the quickstarts use it): bounded start, HTTP helpers, a client that streams generations and
records when each token arrived, and a stop that leaves nothing in /dev/shm."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from .._closing import Closing
from ._control import HttpClient
from ._stop import EXIT_S, gone, held_by, process_tree, remove_owned, stop_server

logger = logging.getLogger(__name__)


def _listening_port(proc: subprocess.Popen[bytes], deadline: float, log: Path, host: str) -> int:
    """The TCP port the server listens on at ``host`` (it was started with ``--port 0``: the kernel picked
    it), read from ``/proc/<pid>/net``: the server's own network namespace, which need not be the caller's."""
    want = ipaddress.ip_address(host)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited ({proc.returncode}) before listening:\n"
                f"{log.read_text(errors='replace')[-3000:]}"
            )
        with contextlib.suppress(OSError):
            for address, port in _listening(proc.pid):
                if address == want:
                    return port
        time.sleep(0.2)
    raise TimeoutError(f"vllm serve (pid {proc.pid}) did not listen within its start-up bound")


def _listening(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, as its network namespace sees it."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) < 10 or fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = fields[1].split(":")
                # each 32-bit word in host (little-endian) order
                raw = b"".join(bytes.fromhex(hexaddr[i : i + 8])[::-1] for i in range(0, len(hexaddr), 8))
                out.append((ipaddress.ip_address(raw), int(hexport, 16)))
    return out


class Server(Closing):
    """``vllm serve MODEL`` with backend ``"groupbridge"`` on loopback (or ``host`` in network namespace
    ``netns``: a simulated host, which only processes on the simulated network reach), a port the kernel
    picks, healthy within ``start_s`` or a ``TimeoutError`` with the end of its log. ``close()`` (or the end
    of a ``with`` block) stops it and removes the shared memory its processes left. ``base`` is its URL.

    It is what ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend":
    "groupbridge"}'`` starts, with small defaults for a small model on a CPU host; the server's output goes
    to ``log`` (default: a new file in the temporary directory, kept after it stops)."""

    def __init__(
        self,
        model: str | Path,
        *,
        log: str | Path | None = None,
        tp: int = 1,
        max_model_len: int = 128,
        kv_cache_bytes: int = 1 << 30,
        dtype: str = "float32",
        start_s: float = 180.0,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        netns: str | None = None,
        host: str = "127.0.0.1",
        stop_s: float = 60.0,
    ) -> None:
        self.model = str(model)
        self.stop_s = stop_s
        """How long ``close()`` lets the server stop in order before its processes are killed."""
        if log is None:
            fd, log = tempfile.mkstemp(prefix="groupbridge-vllm-serve-", suffix=".log")
            os.close(fd)
        self.log = Path(log)
        # two CPU workers on one NUMA node need their cores named (vLLM refuses to guess)
        binds = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))} if tp > 1 else {}
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **binds, **(env or {}))
        # what `vllm serve` runs; the `vllm` command of vllm-cpu 0.32.0 fails looking up its own version
        # (importlib.metadata.version("vllm"): the distribution is named vllm-cpu)
        # netns: in a network namespace (a simulated host of the tests and the benchmark), listening at host
        cmd = [
            *(("ip", "netns", "exec", netns) if netns else ()),
            sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", self.model,
            "--host", host, "--port", "0", "--dtype", dtype, "--skip-tokenizer-init",
            "--max-model-len", str(max_model_len), "--max-num-seqs", "4", "--enforce-eager",
            "--tensor-parallel-size", str(tp), "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--weight-transfer-config", json.dumps({"backend": "groupbridge"}), *extra,
        ]  # fmt: skip
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.removed: list[str] = []
        try:
            deadline = time.monotonic() + start_s
            port = _listening_port(self.proc, deadline, self.log, host)
            self.base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            self.client = HttpClient(self.base, timeout=60)
            """The server's routes (``client.get("v1/models")``, ``client.post("pause")``), each bounded."""
            probe = HttpClient(self.base, timeout=5)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.tail()}")
                try:
                    probe.get("health")
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"vllm serve not healthy within {start_s:g} s:\n{self.tail()}"
                        ) from None
                    time.sleep(0.5)
        except BaseException:
            self.close()
            raise

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def weight_version(self) -> str:
        return str(self.client.get("weight_info")["weight_version"])

    def complete(self, prompt: list[int], max_tokens: int, model: str | None = None) -> list[int]:
        """Greedy token ids for ``prompt`` (from ``model``: the base, or an adapter's name)."""
        body = {"model": model or self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        return list(self.client.post("v1/completions", body)["choices"][0]["token_ids"])

    def close(self) -> None:
        # vLLM 0.32 never unlinks its CPU communicator's segments: whoever starts an engine cleans after it,
        # removing only what this server's processes held (not another engine's, started meanwhile), once
        # they have exited (a killed worker holds its segments until then)
        tree = process_tree([self.proc.pid]) if self.proc.poll() is None else set()
        owned = held_by(tree)
        stop_server(self.proc, self.stop_s)
        left = gone(tree)
        if left:
            logger.warning("groupbridge: vllm serve's processes %s still run %g s after it was stopped", left,
                           EXIT_S)  # fmt: skip
        self.removed = remove_owned(owned)


class Streamer:
    """A client generating from ``server`` without pause (one streamed request after another, ``tokens``
    each, ignoring end of sequence) and recording when each token arrived: what a user of a serving engine
    sees during a weight update. ``stop()`` ends it (bounded) and returns the arrival times."""

    def __init__(self, server: Server, prompt: list[int], tokens: int = 96) -> None:
        self.times: list[float] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        body = json.dumps({
            "model": server.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True,
        }).encode()  # fmt: skip
        url = f"{server.base}/v1/completions"

        def run() -> None:
            while not self._stop.is_set():
                req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        for line in r:
                            if line.startswith(b"data: {"):
                                self.times.append(time.monotonic())
                            if self._stop.is_set():
                                return
                except Exception as e:
                    self.errors.append(e)
                    return

        self._thread = threading.Thread(target=run, name="groupbridge-streamer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60) -> list[float]:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the streaming client did not stop within {timeout:g} s")
        return list(self.times)


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest time in [start, end] in which no token arrived."""
    inside = [start] + [t for t in times if start < t < end] + [end]
    return max(b - a for a, b in itertools.pairwise(inside))
