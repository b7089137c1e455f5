"""`make observe`: a local cluster (`tandem up`) and a Prometheus server scraping it.

``python -m deploy.prometheus.observe [--prometheus-port 9090] [tandem up options]`` starts
``tandem up`` with the given options, reads the endpoints it prints, writes them as file-based
service discovery next to a copy of ``prometheus.yml``, and runs Prometheus on 127.0.0.1 until
interrupted. ``--endpoints FILE`` reads the printed endpoints of a cluster already running
(``tandem up | tee FILE``) instead of starting one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONFIG = os.path.join(HERE, "prometheus.yml")
# One line of `tandem up`'s summary: "<name>  grpc=<host:port>  metrics=<url>".
_ENDPOINT = re.compile(r"^(\S+)\s+grpc=\S+\s+metrics=(\S+)\s*$")
_INSTANCE = re.compile(r"-\d+$")


def parse_endpoints(lines: Iterable[str]) -> dict[str, str]:
    """Process name -> metrics URL, from `tandem up`'s printed summary."""
    endpoints = {}
    for line in lines:
        match = _ENDPOINT.match(line.strip())
        if match:
            endpoints[match.group(1)] = match.group(2)
    return endpoints


def file_sd(endpoints: dict[str, str]) -> list[dict]:
    """Prometheus file_sd target groups: one per process, labelled with its name and role."""
    groups = []
    for name, url in endpoints.items():
        parsed = urllib.parse.urlsplit(url)
        labels = {"process": name, "role": _INSTANCE.sub("", name)}
        if parsed.path not in ("", "/metrics"):
            labels["__metrics_path__"] = parsed.path
        groups.append({"targets": [parsed.netloc], "labels": labels})
    return groups


class Prometheus:
    """A Prometheus server on 127.0.0.1:``port`` with its config and data under ``workdir``."""

    def __init__(self, workdir: str, port: int, binary: str = "prometheus") -> None:
        self.workdir, self.port, self.binary = workdir, port, binary
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_targets(self, endpoints: dict[str, str]) -> None:
        """Point the scrape config at ``endpoints`` (atomically: Prometheus watches the file)."""
        shutil.copyfile(CONFIG, os.path.join(self.workdir, "prometheus.yml"))
        partial = os.path.join(self.workdir, "targets.json.partial")
        with open(partial, "w") as f:
            json.dump(file_sd(endpoints), f, indent=2)
        os.replace(partial, os.path.join(self.workdir, "targets.json"))

    def start(self, endpoints: dict[str, str], timeout_s: float = 30.0) -> None:
        _check_port_free(self.port)
        self.write_targets(endpoints)
        self.popen = subprocess.Popen(
            [
                self.binary,
                f"--config.file={os.path.join(self.workdir, 'prometheus.yml')}",
                f"--storage.tsdb.path={os.path.join(self.workdir, 'data')}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.popen.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready at {self.url} after {timeout_s} s")

    def query(self, expr: str) -> list[dict]:
        """The result vector of an instant query."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        if body["status"] != "success":
            raise RuntimeError(f"query {expr!r}: {body}")
        return body["data"]["result"]

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start_tandem_up(up_args: list[str], echo: bool = True) -> tuple[subprocess.Popen, list[str]]:
    """Start `tandem up`; return it and what it printed, once it printed its summary (the
    cluster is serving then)."""
    popen = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", *up_args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    lines = []
    try:
        for line in popen.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
            if line.startswith("clients:"):
                threading.Thread(target=_drain, args=(popen, echo), daemon=True).start()
                return popen, lines
    except BaseException:  # interrupted while it starts: it is in its own session, stop it
        stop_tandem_up(popen)
        raise
    popen.wait()
    raise RuntimeError(f"tandem up exited with {popen.returncode} before serving:\n" + "".join(lines[-20:]))


def _drain(popen: subprocess.Popen, echo: bool) -> None:
    for line in popen.stdout:
        if echo:
            sys.stdout.write(line)


def _default_sigint() -> None:
    """`tandem up` stops its processes on SIGINT only; a shell that started us in the background
    ignores SIGINT, and children would inherit that. (It runs in its own session, so a Ctrl-C
    reaches only us, and we stop it once.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_tandem_up(popen: subprocess.Popen) -> None:
    """Stop `tandem up` the way Ctrl-C does, so that it stops its processes first."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGINT)
    try:
        popen.wait(timeout=30)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _check_port_free(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise RuntimeError(
                f"127.0.0.1:{port} is taken (Debian's prometheus service listens on "
                "9090 once installed: stop it, or pass --prometheus-port)"
            ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.prometheus.observe",
        description=__doc__.splitlines()[0],
        epilog="Other options go to `tandem up`.",
    )
    parser.add_argument("--prometheus-port", type=int, default=9090)
    parser.add_argument("--prometheus", default="prometheus", help="the prometheus binary")
    parser.add_argument(
        "--endpoints", help="a saved `tandem up` output: scrape that cluster instead of starting one"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args, up_args = build_parser().parse_known_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    cluster = None
    with tempfile.TemporaryDirectory(prefix="tandem-prometheus-") as workdir:
        server = Prometheus(workdir, args.prometheus_port, args.prometheus)
        try:
            if args.endpoints:
                with open(args.endpoints) as f:
                    endpoints = parse_endpoints(f)
            else:
                cluster, summary = start_tandem_up(up_args)
                endpoints = parse_endpoints(summary)
            if not endpoints:
                raise RuntimeError("no endpoints: expected lines like 'router grpc=... metrics=...'")
            server.start(endpoints)
            print(
                f"prometheus at {server.url} scraping {len(endpoints)} processes "
                f'(job="tandem"); Ctrl-C stops it',
                flush=True,
            )
            while server.popen.poll() is None and (cluster is None or cluster.poll() is None):
                time.sleep(0.5)
            print("observe: prometheus or the cluster exited", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        except RuntimeError as e:
            print(f"observe: {e}", file=sys.stderr)
            return 1
        finally:
            server.stop()
            if cluster is not None:
                stop_tandem_up(cluster)


if __name__ == "__main__":
    sys.exit(main())
