"""The fake engine as a real process: protocol v3 on a real socket, no tinygrad, no trio (docs/testing.md,
'Fake engines'). A lane runs it as `FaultPlan.command()`:

    python .../trio_gpuworker/testing/_fake_worker.py --plan JSON --socket PATH --nonce HEX

or with the flags below instead of --plan (a test suite's shorthand may build those). Normal service (one request at
a time; dims are always 4):

    LOAD         PROGRESS(setup) -> LOADED {model_ref: request's or basename(artifact_path), dims 4}
    EMBED_BATCH  PROGRESS(inference) -> VECTORS + f32 rows [sum(ids), n_tokens, item id, req_id]
    RERANK       PROGRESS(inference) -> SCORES + f32 [sum(candidate ids)]; raw = query ids, then each candidate's
    GENERATE     PROGRESS(inference) -> TEXT "fake <sum(ids)>" + i32 generated ids; grammar -> ERR grammar_unsupported
    UNLOAD       UNLOADED;  PING -> PONG;  SHUTDOWN -> WORKER_STOPPED {reason: graceful}, exit 0
    other        ERR {code: unsupported_request};  clean EOF from the daemon -> exit 0

The faults (_plan.py holds their names). Handshake ones act at start; crash_during_load on the N-th LOAD; the rest
on the N-th serving request (EMBED_BATCH, RERANK or GENERATE; N = --on-request, default 1, 0 = every one). With
--once-file the worker misbehaves only if that file does not exist yet, and creates it, so a restarted generation
behaves; a plan's `generations` does the same by the generation the daemon numbered (GPUWORKER_WORKER_ID).

    crash_before_hello            exit 3 before connecting
    garbage_hello                 random bytes as the first frame's payload
    wrong_nonce                   HELLO with another nonce
    v2_hello                      HELLO with v 2
    frame_before_hello            PONG before HELLO
    frame_behind_hello            PONG in the same write as HELLO, before HELLO_ACK
    oversize_hello                a u32 length of 0xFFFFFFF0 as the first frame
    ignore_sigterm                SIGTERM ignored from the start; otherwise normal (forces SIGKILL)
    crash_during_load             PROGRESS(setup), then exit 4
    crash_mid_request             os._exit(5) right after reading the request
    crash_between_header_and_raw  the reply's control frame, then os._exit(6) before its raw frame
    hang_silent                   sleep forever, no progress
    hang_after_progress           one PROGRESS, then sleep forever
    hang_sigstop                  SIGSTOP itself; after SIGCONT it answers normally
    stop_reading                  read nothing more and answer nothing (the socket fills; the daemon's writes stall)
    garbage                       random bytes as a frame payload instead of the reply
    oversize_length               a u32 length of 0xFFFFFFF0 instead of the reply
    regressing_progress           PROGRESS completed 2, then 1; then the reply
    wrong_req_id                  the reply (not its PROGRESS) names req_id + 1
    flood_stderr                  ~1 MiB to stderr and to stdout, then the reply
    slow                          reply after --delay s, PROGRESS every --progress-every s (else silent)
    exit_after_reply              the reply, then exit 0
    stop_after_reply              the reply, then SIGSTOP itself: it never reads the next request

--stream-token-s S: the worker advertises every protocol extension (_proto/_extensions.py) and answers a streamed
GENERATE with one TEXT_DELTA "t<k> " per token every S s, up to max_tokens, watching for CANCEL between tokens
(then ERR request_cancelled, and "fake worker: cancelled after k tokens" on stderr); with crash_mid_request it
exits 5 after the second delta instead.

--fault-rate P [--seed S]: besides any fault, each serving request misbehaves with probability P, drawing from
RANDOM_FAULTS (crash, crash between header and raw, silent hang, garbage, wrong req_id, regressing progress).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import socket
import struct
import sys
import time
import types
from pathlib import Path
from typing import Any

import cbor2

if __name__ == "__main__":
    # Run as a worker: import the sans-I/O core and the plan without trio_gpuworker/__init__ (which pulls in trio,
    # numpy and the supervisor), so the fake starts about as fast as plain Python.
    for _name, _path in (("trio_gpuworker", Path(__file__).resolve().parents[1]),
                         ("trio_gpuworker.testing", Path(__file__).resolve().parent)):
        _package = types.ModuleType(_name)
        _package.__path__ = [str(_path)]
        sys.modules.setdefault(_name, _package)

from trio_gpuworker._lifeline import watch_lifeline
from trio_gpuworker._proto import (
    CLOSED,
    DEFAULT_MAX_FRAME,
    EXT_GRAMMAR,
    EXT_PACKED,
    EXTENSIONS,
    Cancel,
    Connection,
    EmbedBatch,
    Generate,
    HelloAck,
    Load,
    Ping,
    Rerank,
    Shutdown,
    Unload,
    WireMessage,
    hello_fields,
)
from trio_gpuworker._worker_env import WORKER_ID
from trio_gpuworker.testing._plan import HANDSHAKE_FAULTS, REQUEST_FAULTS, FaultPlan

DIMS = 4
SERVING = (EmbedBatch, Rerank, Generate)
BEHAVIORS = (*HANDSHAKE_FAULTS, "ignore_sigterm", "crash_during_load", *REQUEST_FAULTS)  # what --behavior names


def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def garbage_bytes() -> bytes:
    return b"\xff" + random.randbytes(63)  # 0xff (a stray CBOR break) makes it undecodable every time


def ids_of(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}i", raw[: len(raw) // 4 * 4]))


def f32(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


class FakeWorker:
    def __init__(self, args: argparse.Namespace, plan: FaultPlan) -> None:
        self.args = args
        self.plan = plan.for_generation(generation_of(os.environ.get(WORKER_ID, "")))
        self.conn = Connection("worker")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.loads = self.served = 0
        self.models: list[str] = []
        self.completed = 0  # PROGRESS counter of the current request
        self.rng = random.Random(self.plan.seed)

    # --- when to misbehave -------------------------------------------------------------------

    def at_start(self, name: str) -> bool:
        return self.plan.handshake == name and self.plan.claim()

    def at_request(self, count: int) -> str | None:
        fault = self.plan.request_fault(count, self.rng)
        return fault if fault is not None and self.plan.claim() else None

    # --- I/O -----------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, t: str, fields: dict[str, Any], raw: bytes | None = None) -> None:
        for chunk in self.conn.send_map(t, fields, raw):
            self.sock.sendall(chunk)

    def recv(self) -> WireMessage | None:
        """The next message, or None when the daemon closed the connection."""
        while True:
            event = self.conn.next_event()
            if isinstance(event, WireMessage):
                return event
            if event is CLOSED:
                return None
            self.conn.receive_data(self.sock.recv(1 << 16))

    def progress(self, req_id: int, phase: str, completed: int | None = None) -> None:
        self.completed = completed if completed is not None else self.completed + 1
        self.send("PROGRESS", {"req_id": req_id, "completed": self.completed, "phase": phase})

    # --- the session ---------------------------------------------------------------------------

    def run(self) -> int:
        a = self.args
        if self.plan.ignore_sigterm and self.plan.claim():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.at_start("crash_before_hello"):
            return 3
        self.sock.connect(a.socket)
        print(f"fake worker {os.getpid()} connected", file=sys.stderr, flush=True)  # what a crash's log tail shows
        # every extension but grammars (it has none) and batched generation, unless --packed: then it advertises
        # that too and answers GENERATE_PACKED unsupported_request, as a worker whose decoder does not batch does
        flags = ([e for e in EXTENSIONS if e != EXT_GRAMMAR and (e != EXT_PACKED or a.packed)]
                 if a.stream_token_s else [])
        engine = {"engine": "fake", "version": "1", "build_flags": flags}
        hello = hello_fields(a.nonce, os.getpid(), DEFAULT_MAX_FRAME, engine)
        if self.at_start("garbage_hello"):
            self.write(frame(garbage_bytes()))
        elif self.at_start("oversize_hello"):
            self.write(struct.pack("<I", 0xFFFFFFF0))
        elif self.at_start("frame_before_hello"):
            self.write(frame(cbor2.dumps({"t": "PONG", "req_id": 0, "rss_mb": 1.0, "models_loaded": []})))
        elif self.at_start("frame_behind_hello"):
            pong = frame(cbor2.dumps({"t": "PONG", "req_id": 0, "rss_mb": 1.0, "models_loaded": []}))
            self.write(b"".join(self.conn.send_map("HELLO", hello)) + pong)  # one write: one recv on the daemon's side
        elif self.at_start("v2_hello"):
            self.write(frame(cbor2.dumps({"t": "HELLO", **hello, "v": 2})))  # our own Connection sends only v3
        else:
            if self.at_start("wrong_nonce"):
                hello["nonce"] = "00" * 16 if a.nonce != "00" * 16 else "11" * 16
            self.send("HELLO", hello)
        while (msg := self.recv()) is not None:
            if isinstance(msg, HelloAck):
                self.conn.set_max_frame(msg.max_frame)
            elif isinstance(msg, Shutdown) and msg.req_id is None:  # out of band: abort_in_flight
                print(f"fake worker: SHUTDOWN {msg.mode} out of band", file=sys.stderr, flush=True)
                self.send("WORKER_STOPPED", {"reason": (msg.mode or "abort_in_flight")})
                return 0
            elif isinstance(msg, Cancel):
                pass  # of a request already answered
            elif getattr(msg, "req_id", None) is not None:
                self.completed = 0
                if self.serve(msg):
                    return 0
            # notifications (wake hints) need no answer
        return 0

    def serve(self, msg: WireMessage) -> bool:
        """Answer one request; True when the worker should exit."""
        req_id = msg.req_id
        if isinstance(msg, Load):
            self.loads += 1
            self.progress(req_id, "setup")
            if self.plan.crashes_in_load(self.loads) and self.plan.claim():
                os._exit(4)
            started = time.monotonic()
            delay = self.plan.load_delay(self.loads)
            if delay:
                time.sleep(delay)
            model_ref = msg.model_ref or os.path.basename(msg.artifact_path)
            if self.args.record_loads:  # what this worker was asked to load, for tests of the settings it got
                with open(self.args.record_loads, "a") as f:
                    f.write(json.dumps({"pid": os.getpid(), "model_ref": model_ref,
                                        "runtime_config": msg.runtime_config}) + "\n")
            if model_ref not in self.models:
                self.models.append(model_ref)
            cold_load_ms = (time.monotonic() - started) * 1000
            self.send("LOADED", {"req_id": req_id, "model_ref": model_ref, "dims": DIMS, "cold_load_ms": cold_load_ms})
        elif isinstance(msg, SERVING):
            self.served += 1
            self.serve_inference(msg, self.at_request(self.served))
        elif isinstance(msg, Unload):
            if msg.model_ref in self.models:
                self.models.remove(msg.model_ref)
            self.send("UNLOADED", {"req_id": req_id})
        elif isinstance(msg, Ping):
            rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            self.send("PONG", {"req_id": req_id, "rss_mb": rss_mb, "models_loaded": list(self.models)})
        elif isinstance(msg, Shutdown):
            self.send("WORKER_STOPPED", {"reason": "graceful", "req_id": req_id})
            return True
        else:
            self.send("ERR", {"req_id": req_id, "code": "unsupported_request", "msg": f"fake worker: no {msg.T}"})
        return False

    def serve_inference(self, msg: WireMessage, behavior: str | None) -> None:
        req_id = msg.req_id
        if isinstance(msg, Generate) and msg.stream and self.args.stream_token_s:
            return self.stream(msg, behavior)
        if behavior == "crash_mid_request":
            os._exit(5)
        if behavior == "hang_sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif behavior in ("hang_silent", "stop_reading"):
            hang()
        if behavior == "flood_stderr":
            line = "fake worker flood " * 7 + "\n"  # 127 bytes
            for stream in (sys.stderr, sys.stdout):
                stream.write(line * 8257)  # ~1 MiB
                stream.flush()
        if behavior == "slow":
            deadline = time.monotonic() + self.plan.slow_s
            while (left := deadline - time.monotonic()) > 0:
                every = self.plan.progress_every_s
                time.sleep(min(left, every) if every else left)
                if every and deadline - time.monotonic() > 0:
                    self.progress(req_id, "inference")
        if behavior == "regressing_progress":
            self.progress(req_id, "inference", 2)
            self.progress(req_id, "inference", 1)
        else:
            self.progress(req_id, "inference")
        if behavior == "hang_after_progress":
            hang()
        t, fields, raw = self.reply(msg)
        if behavior == "wrong_req_id":
            fields["req_id"] += 1
        if t == "ERR" or behavior not in ("garbage", "oversize_length", "crash_between_header_and_raw"):
            self.send(t, fields, raw)
        elif behavior == "garbage":
            self.write(frame(garbage_bytes()))
        elif behavior == "oversize_length":
            self.write(struct.pack("<I", 0xFFFFFFF0))
        else:
            self.write(self.conn.send_map(t, fields, raw)[0])
            os._exit(6)
        if behavior == "exit_after_reply":
            self.sock.close()
            os._exit(0)
        if behavior == "stop_after_reply":
            os.kill(os.getpid(), signal.SIGSTOP)

    def stream(self, msg: WireMessage, behavior: str | None) -> None:
        req_id, text = msg.req_id, ""
        for k in range(1, msg.max_tokens + 1):
            if self.cancelled(req_id):
                print(f"fake worker: cancelled after {k - 1} tokens", file=sys.stderr, flush=True)
                self.send("ERR", {"req_id": req_id, "code": "request_cancelled", "msg": "CANCEL stopped it"})
                return
            self.progress(req_id, "inference")
            self.send("TEXT_DELTA", {"req_id": req_id, "text": f"t{k} ", "n_gen": k})
            text += f"t{k} "
            if k == 2 and behavior == "crash_mid_request":
                os._exit(5)
        ids = ids_of(msg.raw or b"")
        self.send("TEXT", {"req_id": req_id, "text": text, "n_prompt": len(ids), "n_gen": msg.max_tokens,
                           "finish_reason": "length"}, struct.pack(f"<{msg.max_tokens}i", *range(msg.max_tokens)))

    def cancelled(self, req_id: int) -> bool:
        """Wait one token's time for a CANCEL of `req_id` (anything else arriving meanwhile is a protocol bug)."""
        deadline = time.monotonic() + self.args.stream_token_s
        while (left := deadline - time.monotonic()) > 0:
            event = self.conn.next_event()
            if isinstance(event, WireMessage):
                return isinstance(event, Cancel) and event.req_id == req_id
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                return False
            finally:
                self.sock.settimeout(None)
            self.conn.receive_data(data)
        return False

    @staticmethod
    def reply(msg: WireMessage) -> tuple[str, dict[str, Any], bytes | None]:
        """The normal reply to a serving request: (type, fields, raw frame)."""
        req_id, ids, at = msg.req_id, ids_of(msg.raw or b""), 0
        if isinstance(msg, EmbedBatch):
            rows: list[float] = []
            for item in msg.items:
                n = item["n_tokens"]
                rows += [float(sum(ids[at : at + n])), float(n), float(item["id"]), float(req_id)]
                at += n
            t, fields, raw = "VECTORS", {"req_id": req_id, "dims": DIMS, "n": len(msg.items)}, f32(rows)
        elif isinstance(msg, Rerank):
            at = msg.query_n_tokens
            scores: list[float] = []
            for cand in msg.candidates:
                scores.append(float(sum(ids[at : at + cand["n_tokens"]])))
                at += cand["n_tokens"]
            t, fields, raw = "SCORES", {"req_id": req_id, "n": len(scores)}, f32(scores)
        else:
            if msg.grammar:
                return "ERR", {"req_id": req_id, "code": "grammar_unsupported", "msg": "fake worker: no grammars"}, None
            gen, at = [1, 2, 3][: msg.max_tokens], len(ids)
            t, raw = "TEXT", struct.pack(f"<{len(gen)}i", *gen)
            fields = {"req_id": req_id, "text": f"fake {sum(ids)}", "n_prompt": len(ids), "n_gen": len(gen),
                      "finish_reason": "length" if len(gen) == msg.max_tokens else "stop"}
        if at != len(ids):
            msg_ = f"the request names {at} token ids, its raw frame holds {len(ids)}"
            return "ERR", {"req_id": req_id, "code": "invalid_request", "msg": msg_}, None
        return t, fields, raw


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", help="a FaultPlan as JSON (FaultPlan.to_json); the fault flags below build one else")
    p.add_argument("--behavior", choices=BEHAVIORS)
    p.add_argument("--on-request", type=int, default=1)
    p.add_argument("--once-file")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--record-loads", default=None, help="append each LOAD's model_ref and runtime_config here")
    p.add_argument("--load-delay", type=float, default=0.0, help="every LOAD after the first takes this long")
    p.add_argument("--first-load-delay", type=float, default=0.0, help="the first LOAD takes this long (silent)")
    p.add_argument("--progress-every", type=float)
    p.add_argument("--stream-token-s", type=float, default=0.0, help="stream GENERATE, a token every S s")
    p.add_argument("--fault-rate", type=float, default=0.0, help="probability of a random fault per serving request")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--packed", type=int, default=0, help="1: advertise batched generation too (and not serve it)")
    p.add_argument("--socket", required=True)
    p.add_argument("--nonce", required=True)
    return p.parse_args(argv)


def plan_of(args: argparse.Namespace) -> FaultPlan:
    """The plan --plan gives, or the one the fault flags say."""
    if args.plan is not None:
        return FaultPlan.from_json(args.plan)
    b, n = args.behavior, args.on_request
    return FaultPlan(faults={n: b} if b in REQUEST_FAULTS else {}, fault_rate=args.fault_rate, seed=args.seed,
                     handshake=b if b in HANDSHAKE_FAULTS else None,
                     crash_in_load=n if b == "crash_during_load" else None, load_s=args.load_delay,
                     first_load_s=args.first_load_delay, slow_s=args.delay, progress_every_s=args.progress_every,
                     ignore_sigterm=b == "ignore_sigterm",
                     once_file=Path(args.once_file) if args.once_file else None)


def generation_of(worker_id: str) -> int:
    """The generation in the daemon's "<lane>.<generation>" worker id (0 when it set none)."""
    tail = worker_id.rpartition(".")[2]
    return int(tail) if tail.isdigit() else 0


def hang() -> None:
    while True:
        time.sleep(3600)


def main() -> int:
    watch_lifeline()  # as an engine should: it dies with the daemon, however the daemon ends
    args = parse_args()
    worker = FakeWorker(args, plan_of(args))
    try:
        return worker.run()
    except ConnectionError:  # the daemon hung up on us mid-write or mid-read: nothing left to say
        return 0


if __name__ == "__main__":
    sys.exit(main())
