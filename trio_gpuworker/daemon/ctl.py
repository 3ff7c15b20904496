"""gpuworkerctl: talk to a running gpuworkerd over its Unix socket (admin routes live there).

    gpuworkerctl status                       lanes: state, generation, pid, strikes, rss, queue, models
    gpuworkerctl models
    gpuworkerctl load LANE MODEL              LOAD with a progress bar fed by the worker's PROGRESS
    gpuworkerctl unload LANE MODEL
    gpuworkerctl reload LANE                  ordered restart of the lane's worker (lifts quarantine)
    gpuworkerctl drain LANE [--wait] | resume LANE
    gpuworkerctl reload-config                what SIGHUP does, with the report
    gpuworkerctl embed -m MODEL TEXT...       (texts from stdin, one per line, when none are given)
    gpuworkerctl rerank -m MODEL QUERY DOC... [--top-n N]
    gpuworkerctl generate -m MODEL PROMPT [--max-tokens N] [--chat]
    gpuworkerctl tune MODEL [--config F] [--beam N]
                                              BEAM-search the model's kernels into the state directory's
                                              caches (no daemon needed; a progress bar per warm-up shape)

--json prints the daemon's JSON answer for scripts. The socket is --socket, else $GPUWORKER_SOCKET, else
$GPUWORKER_UNIX_SOCKET, else /run/gpuworkerd/api.sock; --url http://127.0.0.1:8421 uses TCP instead.
Exit status: 0 done, 1 the daemon answered with an error, 2 usage, 3 the daemon cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import socket as _socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import httpx

DEFAULT_SOCKET = "/run/gpuworkerd/api.sock"
BAR_WIDTH = 30
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


class CtlError(Exception):
    def __init__(self, message: str, status: int = EXIT_ERROR, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def socket_path(arg: str | None, env: dict[str, str] | os._Environ[str]) -> str:
    return arg or env.get("GPUWORKER_SOCKET") or env.get("GPUWORKER_UNIX_SOCKET") or DEFAULT_SOCKET


class Client:
    def __init__(self, socket: str | None, url: str | None, timeout_s: float) -> None:
        if url:
            self.where = url
            self.http = httpx.Client(base_url=url, timeout=timeout_s)
        else:
            self.where = f"unix:{socket}"
            self._probe(socket)
            self.http = httpx.Client(base_url="http://gpuworkerd", timeout=timeout_s,
                                     transport=httpx.HTTPTransport(uds=socket))

    def _probe(self, path: str) -> None:
        """Fail early, with the reason, when nothing listens there (and leak no socket doing so)."""
        with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError as exc:
                raise CtlError(f"cannot reach gpuworkerd at {self.where}: {exc.strerror or exc}",
                               EXIT_UNREACHABLE) from exc

    def close(self) -> None:
        self.http.close()

    @staticmethod
    def _check(r: httpx.Response) -> Any:
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.status_code >= 400:
            err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
            raise CtlError(f"{r.status_code} {err.get('code', 'error')}: {err.get('message', r.text)}", body=body)
        return body

    def _unreachable(self, exc: httpx.HTTPError) -> CtlError:
        return CtlError(f"cannot reach gpuworkerd at {self.where}: {exc}", EXIT_UNREACHABLE)

    def get(self, path: str) -> Any:
        try:
            return self._check(self.http.get(path))
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc

    def post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            return self._check(self.http.post(path, json=body))
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """NDJSON events of a streamed admin request."""
        try:
            with self.http.stream("POST", path, json={**body, "stream": True}) as r:
                if r.status_code >= 400:
                    r.read()
                    self._check(r)
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc


# --- output --------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "-"
    return str(value)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    cells = [[title for title, _ in columns]] + [[_fmt(r.get(key)) for _, key in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def status_rows(lanes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for ln in lanes:
        state = ln["state"] + (" (drained)" if ln.get("drained") else "")
        if ln.get("cooldown_remaining_s") is not None:
            state += f" {ln['cooldown_remaining_s']:.0f}s"
        sb = ln.get("standby")
        standby = f"{sb['state']} g{sb['generation']} pid {sb['pid']}" if sb else None
        kernels = ", ".join(sorted(set((ln.get("kernels") or {}).values()))) or None  # tuned, untuned, fused...
        out.append({**ln, "state": state, "standby": standby, "kernels": kernels})
    return out


LANE_COLUMNS = [("LANE", "lane_id"), ("STATE", "state"), ("GEN", "generation"), ("PID", "pid"),
                ("STRIKES", "strikes"), ("RSS_MB", "rss_mb"), ("QUEUED", "queued"), ("RESTARTS", "restarts"),
                ("STANDBY", "standby"), ("KERNELS", "kernels"), ("MODELS", "models")]


class Progress:
    """A one-line bar: PROGRESS carries a step count and a phase, not a total, so the bar fills by phase
    (setup, inference, control) and shows the steps; on a non-terminal each update is a line."""

    PHASES = ("setup", "inference", "control")

    def __init__(self, label: str, out: TextIO, total: int | None = None) -> None:
        self.label, self.out, self.total = label, out, total
        self.tty = out.isatty()
        self.t0 = time.monotonic()
        self.state = ""

    def update(self, event: dict[str, Any]) -> None:
        if event.get("event") == "state":
            self.state = f"{event['state']} g{event['generation']}"
            done = 0
            text = self.state
        elif self.total:  # steps after the first are warm-up shapes: the bar fills by shape
            shapes = min(max(int(event.get("completed") or 1) - 1, 0), self.total)
            done = BAR_WIDTH * shapes // self.total
            text = f"shape {shapes}/{self.total}"
        else:
            phase = event.get("phase") or "setup"
            idx = self.PHASES.index(phase) if phase in self.PHASES else 0
            done = int(BAR_WIDTH * (idx + 1) / (len(self.PHASES) + 1))
            text = f"{phase} step {event.get('completed')}"
        bar = "#" * done + "-" * (BAR_WIDTH - done)
        line = f"{self.label} [{bar}] {text} {time.monotonic() - self.t0:.1f}s"
        self.out.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
        self.out.flush()

    def finish(self, ok: bool) -> None:
        bar = ("#" if ok else "!") * BAR_WIDTH
        line = f"{self.label} [{bar}] {'done' if ok else 'failed'} {time.monotonic() - self.t0:.1f}s"
        self.out.write(f"\r{line}\x1b[K\n" if self.tty else line + "\n")
        self.out.flush()


# --- commands ------------------------------------------------------------------------------------


def run_streamed(client: Client, path: str, body: dict[str, Any], label: str, args: argparse.Namespace,
                 err: TextIO) -> Any:
    bar = None if args.json else Progress(label, err)
    for event in client.stream(path, body):
        kind = event.get("event")
        if kind in ("progress", "state"):
            if bar is not None:
                bar.update(event)
        elif kind == "done":
            if bar is not None:
                bar.finish(True)
            return event["result"]
        elif kind == "error":
            if bar is not None:
                bar.finish(False)
            e = event.get("error", {})
            raise CtlError(f"{event.get('status')} {e.get('code')}: {e.get('message')}", body=event)
    raise CtlError("the daemon closed the stream without a result")


def command(args: argparse.Namespace, client: Client, out: TextIO, err: TextIO, stdin: TextIO) -> Any:
    """Run one command; returns what --json prints, having printed the human form otherwise."""
    c = args.cmd
    if c == "status":
        body = client.get("/v1/lanes")
        if not args.json:
            out.write(table(status_rows(body["data"]), LANE_COLUMNS) + "\n")
        return body
    if c == "models":
        body = client.get("/v1/models")
        if not args.json:
            out.write(table(body["data"], [("MODEL", "id"), ("KIND", "kind"), ("LANES", "lanes"),
                                           ("READY ON", "ready_lanes")]) + "\n")
        return body
    if c in ("load", "reload"):
        path = f"/v1/lanes/{args.lane}/{c}"
        body = {"model": args.model} if c == "load" else {}
        label = f"{c} {args.model} on {args.lane}" if c == "load" else f"reload {args.lane}"
        result = run_streamed(client, path, body, label, args, err)
        if not args.json:
            out.write(f"{args.lane}: generation {result['generation']}"
                      + (f", {result['model']} loaded ({result.get('dims')} dims)" if c == "load" else "") + "\n")
        return result
    if c == "unload":
        result = client.post(f"/v1/lanes/{args.lane}/unload", {"model": args.model})
        if not args.json:
            out.write(f"{args.lane}: {args.model} unloaded; loaded now: {_fmt(result['models'])}\n")
        return result
    if c in ("drain", "resume"):
        result = client.post(f"/v1/lanes/{args.lane}/{c}", {"wait": args.wait} if c == "drain" else {})
        if not args.json:
            idle = "" if c == "resume" else f", {'idle' if result['idle'] else 'still busy'}"
            out.write(f"{args.lane}: {'drained' if result['drained'] else 'routed'}{idle}\n")
        return result
    if c == "reload-config":
        result = client.post("/v1/config/reload", {})
        if not args.json:
            lines = [f"{k.replace('_', ' ')}: {', '.join(v)}" for k, v in result.items() if v]
            out.write("\n".join(lines or ["no changes"]) + "\n")
        return result
    if c == "embed":
        texts = args.text or [line.rstrip("\n") for line in stdin if line.strip()]
        if not texts:
            raise CtlError("no texts given (arguments or stdin)", EXIT_USAGE)
        body = client.post("/v1/embeddings", {"model": args.model, "input": texts})
        if not args.json:
            for d, t in zip(body["data"], texts, strict=True):
                v = d["embedding"]
                head = " ".join(f"{x:+.4f}" for x in v[:4])
                out.write(f"{d['index']}\t{len(v)} dims\t[{head} ...]\t{t[:40]}\n")
        return body
    if c == "rerank":
        req: dict[str, Any] = {"model": args.model, "query": args.query, "documents": args.documents}
        if args.top_n:
            req["top_n"] = args.top_n
        body = client.post("/v1/rerank", req)
        if not args.json:
            out.write(f"method: {body.get('method')}\n")
            for r in body["results"]:
                out.write(f"{r['relevance_score']:.4f}\t{r['index']}\t{args.documents[r['index']][:60]}\n")
        return body
    if c == "generate":
        cap = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}  # none: until EOS or the context
        if args.chat:
            body = client.post("/v1/chat/completions", {"model": args.model, **cap,
                                                        "messages": [{"role": "user", "content": args.prompt}]})
            text = body["choices"][0]["message"]["content"]
        else:
            body = client.post("/v1/completions", {"model": args.model, "prompt": args.prompt, **cap})
            text = body["choices"][0]["text"]
        if not args.json:
            out.write(text + "\n")
        return body
    raise CtlError(f"unknown command {c!r}", EXIT_USAGE)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuworkerctl", description="control a running gpuworkerd",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--socket", help=f"the daemon's Unix socket (default {DEFAULT_SOCKET})")
    p.add_argument("--url", help="talk HTTP to this base URL instead (no admin routes unless admin_on_tcp)")
    p.add_argument("--json", action="store_true", help="print the JSON answer (for scripts)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the daemon (default 900)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="lane table")
    sub.add_parser("models", help="configured models and where they are loaded")
    for name in ("load", "unload"):
        s = sub.add_parser(name, help=f"{name} a model on a lane")
        s.add_argument("lane")
        s.add_argument("model")
    sub.add_parser("reload", help="ordered restart of a lane's worker").add_argument("lane")
    d = sub.add_parser("drain", help="route no new requests to a lane")
    d.add_argument("lane")
    d.add_argument("--wait", action="store_true", help="until its queued requests have finished")
    sub.add_parser("resume", help="route requests to a drained lane again").add_argument("lane")
    sub.add_parser("reload-config", help="re-read the configuration file (as SIGHUP)")
    e = sub.add_parser("embed", help="embeddings of texts")
    e.add_argument("-m", "--model", required=True)
    e.add_argument("text", nargs="*")
    r = sub.add_parser("rerank", help="relevance of documents to a query")
    r.add_argument("-m", "--model", required=True)
    r.add_argument("--top-n", type=int)
    r.add_argument("query")
    r.add_argument("documents", nargs="+")
    g = sub.add_parser("generate", help="greedy completion (max 64 tokens)")
    g.add_argument("-m", "--model", required=True)
    g.add_argument("--max-tokens", type=int, default=None, help="default: until EOS or the model's context")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("prompt")
    t = sub.add_parser("tune", help="BEAM-search a model's warm-up shapes into the daemon's caches")
    t.add_argument("model")
    t.add_argument("--config", type=Path, default=None, help="the daemon's TOML config (default: embedded)")
    t.add_argument("--beam", type=int, default=None, help="search width (default: the model's `beam`)")
    return p


def run_tune(args: argparse.Namespace, out: TextIO, err: TextIO) -> Any:
    """`tune` runs its own worker (daemon/tune.py): no daemon, no socket."""
    import trio

    from .._errors import GpuWorkerError
    from .config import load_config
    from .tune import planned_steps, tune

    try:
        cfg = load_config(args.config)
        total = planned_steps(cfg, args.model)
        bar = None if args.json else Progress(f"tune {args.model}", err, total=total)
        result = trio.run(lambda: tune(cfg, args.model, args.beam, bar.update if bar else None))
    except (GpuWorkerError, KeyError, OSError) as exc:
        if not args.json:
            Progress(f"tune {args.model}", err).finish(False)
        raise CtlError(str(exc)) from exc
    if bar is not None:
        bar.finish(True)
    if not args.json:
        out.write(f"{args.model}: beam {result['beam']} on {result['device']}, {result['summary']}; "
                  f"{result['seconds']} s in all; cached under {result['state_dir']}\n")
        if result["configured_beam"] != result["beam"]:
            out.write(f"note: the daemon's config has beam = {result['configured_beam']} for {args.model}; set "
                      f"beam = {result['beam']} there for its workers to use these kernels\n")
    return result


def main(argv: list[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None,
         stdin: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    out, err, stdin = out or sys.stdout, err or sys.stderr, stdin or sys.stdin
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and EXIT_USAGE
    if args.cmd == "tune":
        try:
            result = run_tune(args, out, err)
        except CtlError as exc:
            err.write(f"gpuworkerctl: {exc}\n")
            return exc.status
        if args.json:
            out.write(json.dumps(result, indent=2) + "\n")
        return EXIT_OK
    try:
        client = Client(socket_path(args.socket, env if env is not None else os.environ), args.url, args.timeout)
    except CtlError as exc:
        err.write(f"gpuworkerctl: {exc}\n")
        return exc.status
    try:
        result = command(args, client, out, err, stdin)
    except CtlError as exc:
        if args.json and exc.body is not None:
            out.write(json.dumps(exc.body) + "\n")
        err.write(f"gpuworkerctl: {exc}\n")
        return exc.status
    finally:
        client.close()
    if args.json:
        out.write(json.dumps(result, indent=2) + "\n")
    return EXIT_OK
