"""The control plane never unpickles: messages are signed JSON, and frames that are tampered with,
unsigned or signed with another pool's key are refused before they are parsed (replays and
reordering: ``test_control_replay.py``). Under torchrun the secret comes from the operator."""
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from orca_lab import LLM, EngineConfig
from orca_lab.distributed.channels import Inbox, connect
from orca_lab.distributed.messages import Challenge, ControlMessage, Hello, Proof, Reset, StageReport, Stop, WorkerError
from orca_lab.distributed.pool import WorkerPool
from orca_lab.distributed.wire import ControlError, decode, encode
from orca_lab.engine.sampling_params import SamplingParams

SECRET = bytes(range(32))
MESSAGES = [
    ControlMessage(7, (3, 9), (0, 12), (5, 1), ((1, 2, 3, 4, 5), (8,)), ("prefill", "decode"), (False, True), False,
                   {3: ((0, 1, 2, 3, 4, 5, 6), SamplingParams(max_gen_tokens=3, temperature=0.5, top_k=4, seed=1), ()),
                    9: ((7, 8), SamplingParams(logit_bias={5: -2.5}, repetition_penalty=1.5, prompt_logprobs=1), (8, 1, 2))},
                   (2,)),
    Reset(), Stop(), StageReport(7, 1, 1.5, 2.25, [4, 5]), StageReport(7, 0, 1.0, 1.5), WorkerError(3, "Traceback"),
    StageReport(7, 1, 1.5, 2.25, [4, 5], [[3, [4, -0.25, [[4, -0.25], [9, -2.0]]], [None, [2, -1.5, []]]]]),
    Hello(-1, "ab" * 32), Challenge("cd" * 32, "ef" * 32), Proof("01" * 32),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    got = decode(encode(msg, SECRET), SECRET)
    assert type(got) is type(msg)
    if isinstance(msg, ControlMessage):        # tuples come back as lists: compare what workers read
        assert got.reserve == msg.reserve and got.iteration == msg.iteration
        assert [list(t) for t in got.tokens] == [list(t) for t in msg.tokens] and list(got.rids) == list(msg.rids)
        assert list(got.yields) == list(msg.yields)
    else:
        assert got == msg


class Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled!')",))


@pytest.mark.parametrize("frame", [
    lambda raw: raw[:40] + bytes([raw[40] ^ 1]) + raw[41:],                 # one bit of the body flipped
    lambda raw: bytes([raw[0] ^ 1]) + raw[1:],                              # the tag flipped
    lambda raw: raw[32:],                                                   # unsigned JSON
    lambda raw: bytes(32) + raw[32:],                                       # a zero tag
    lambda raw: encode(Stop(), b"another pool's secret, 32 bytes!"),        # another key
    lambda raw: pickle.dumps(Stop()),                                       # a pickle
    lambda raw: bytes(32) + pickle.dumps(Boom()),                           # a malicious pickle
    lambda raw: b"",
], ids=["body", "tag", "unsigned", "zero-tag", "other-key", "pickle", "evil-pickle", "empty"])
def test_tampered_or_unsigned_frames_are_refused(frame):
    raw = encode(MESSAGES[0], SECRET)
    with pytest.raises(ControlError, match="refused"):
        decode(frame(raw), SECRET)


def test_a_signed_frame_that_is_no_message_is_refused():
    import hmac
    for body in (b'["Boom", {}]', b'["Stop", {"x": 1}]', b'not json'):
        with pytest.raises(ControlError, match="not a valid message"):
            decode(hmac.digest(SECRET, body, "sha256") + body, SECRET)


def test_the_inbox_drops_strangers_and_accepts_a_signed_hello():
    inbox = Inbox("127.0.0.1", SECRET)
    try:
        stranger = socket.create_connection(inbox.address)       # a raw pickle, then nothing
        stranger.sendall(len(pickle.dumps(Hello(0, ""))).to_bytes(4, "big") + pickle.dumps(Hello(0, "")))
        other = connect(inbox.address, b"x" * 32, 1)             # signed with another key
        ours = connect(inbox.address, SECRET, 2)
        got = inbox.accept(5)
        assert got is not None and got[1] == 2                   # the first two were dropped
        ours.send(Reset())
        assert got[0].recv() == Reset()
        for c in (stranger, other, ours, got[0]):
            c.close()
    finally:
        inbox.close()


def test_a_refused_opening_and_its_owner_may_close_the_channel_at_once(monkeypatch):
    """The opening's thread closes a refused channel as its owner may: both closing one fd raced
    (EBADF in CI). A slow close widens the window the race needs."""
    from multiprocessing.connection import Connection
    close = Connection._close
    monkeypatch.setattr(Connection, "_close", lambda self: (time.sleep(0.2), close(self)))
    inbox = Inbox("127.0.0.1", SECRET)
    try:
        other = connect(inbox.address, b"x" * 32, 1)
        assert inbox.accept(0.1) is None                        # dropped: the thread starts to close
        time.sleep(0.05)
        other.close()
        with pytest.raises(ConnectionError, match="it closed the connection"):
            other.recv()
    finally:
        inbox.close()


def _strangers(address):
    """Four kinds of stranger: silent, half a frame then silent, a frame no hello is that long, and
    a hello signed with another key."""
    silent, half, huge = (socket.create_connection(address) for _ in range(3))
    half.sendall((100).to_bytes(4, "big") + b"x" * 10)
    huge.sendall((1 << 30).to_bytes(4, "big"))
    return [silent, half, huge, connect(address, b"y" * 32, 7)]


def test_strangers_hold_up_neither_the_peer_nor_the_deadline():
    """Strangers connect first, the real peer last: accept hands over the peer within one deadline,
    never waiting on a stranger (before, each could hold it 10 s, and half a frame for ever)."""
    inbox = Inbox("127.0.0.1", SECRET)
    conns = []
    try:
        conns += _strangers(inbox.address)
        conns.append(connect(inbox.address, SECRET, 3))
        got = []
        worker = threading.Thread(target=lambda: got.append(inbox.accept(5.0)), daemon=True)
        worker.start()
        conns[-1].send(Reset())                  # sent right after the opening: it stays for the channel
        worker.join(30)
        assert not worker.is_alive(), "accept hung on a stranger"
        assert got[0] is not None and got[0][1] == 3
        assert got[0][0].recv() == Reset()
        conns.append(got[0][0])
        t0 = time.monotonic()
        assert inbox.accept(0.3) is None         # only strangers left: the deadline holds
        assert time.monotonic() - t0 < 5         # (generous: the old loop waited 10 s per stranger)
    finally:
        for c in conns:
            c.close()
        inbox.close()


def test_a_silent_stranger_is_dropped_after_the_hello_time(monkeypatch):
    """The deadline logic itself, on a clock the test moves: a connection that says nothing for
    HELLO_S is closed, while accept keeps to its own deadline."""
    now = [1000.0]
    inbox = Inbox("127.0.0.1", SECRET)
    inbox.clock = lambda: now[0]
    silent = socket.create_connection(inbox.address)
    try:
        real_select = inbox._selector.select

        def select(timeout):             # time passes by the timeout asked for, at most
            events = real_select(0.05)
            now[0] += 0 if events else timeout
            return events
        monkeypatch.setattr(inbox._selector, "select", select)
        assert inbox.accept(3.0) is None and len(inbox._greeting) == 1     # 3 s: still greeted
        assert inbox.accept(Inbox.HELLO_S) is None and not inbox._greeting  # past HELLO_S: dropped
        silent.settimeout(5)
        assert silent.recv(1) == b""                                         # closed on our side
    finally:
        silent.close()
        inbox.close()


def test_a_worker_refuses_a_tampered_control_frame(tiny_llm):
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=256, executor="workers"))
    with WorkerPool(llm, attach=False) as pool:
        raw = encode(Reset(), pool._secret)
        pool._control[0].send_raw(raw.replace(b"Reset", b"Stop"))  # a valid Stop, but not what was signed
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"(?s)worker rank 0 failed:.*ControlError: refused a control frame"):
            pool.collect(1, timeout=30)
        assert time.monotonic() - t0 < 10


# -- a rank whose master died or hung gives up within --master-timeout --------------------------------
# 10 s, not less: on a loaded 2-core host a healthy master's heartbeat thread was once starved for
# 3 s while the pair started, and its worker gave up (a fresh-clone CI run with two CPU hogs).
MASTER_TIMEOUT_S = 10


OPERATOR_SECRET = "an operator's secret, 32 chars or more: 7f3a9c"


def _without_secret() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("ORCA_LAB_SECRET")}


def start_rank(rank, port, tmp_path, *extra, secret=None):
    """``python -m orca_lab.torchrun`` as one rank of a 1 x 2 world whose rendezvous store is
    hosted elsewhere (as torchrun's agent hosts it), so the store outlives rank 0 and the test can
    read all of it. ``secret``: the operator's variables (default ORCA_LAB_SECRET)."""
    env = dict(_without_secret(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               **(secret or {"ORCA_LAB_SECRET": OPERATOR_SECRET}))
    cmd = [sys.executable, "-m", "orca_lab.torchrun", "--tp", "1", "--pp", "2", "--device", "cpu",
           "--systems", "orca", "--master-timeout", str(MASTER_TIMEOUT_S), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_rank_gives_up_on_a_master_that_never_came_or_hung(tmp_path):
    lonely_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t_lonely = time.monotonic()
    lonely = start_rank(1, lonely_store.port, tmp_path)          # its rank 0 never starts
    master = start_rank(0, agent.port, tmp_path, "--n-requests", "100000")
    worker = start_rank(1, agent.port, tmp_path)
    procs = [lonely, master, worker]
    try:
        store, deadline = dist.PrefixStore("orca_lab", agent), time.monotonic() + 120
        while not store.check(["ready/1"]):                      # the pair is up and serving
            assert master.poll() is None, master.communicate()[1][-3000:]
            assert worker.poll() is None, worker.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        os.kill(master.pid, signal.SIGSTOP)                       # the master hangs: its sockets stay open
        t0 = time.monotonic()
        _, err = worker.communicate(timeout=30)
        assert worker.returncode == 1, err[-3000:]
        assert time.monotonic() - t0 < MASTER_TIMEOUT_S + 5
        assert (f"worker rank 1: the engine master (rank 0) sent no heartbeat for {MASTER_TIMEOUT_S} s (it died or "
                "hung); giving up") in err

        _, err = lonely.communicate(timeout=60)
        assert lonely.returncode == 1 and f"sent no heartbeat for {MASTER_TIMEOUT_S} s" in err, err[-3000:]
        assert time.monotonic() - t_lonely < 90                  # imports included, on a loaded machine
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


# -- torchrun: the control secret comes from the operator, never through the store -----------------
def _secret_env(how, tmp_path):
    if how == "env":
        return {"ORCA_LAB_SECRET": OPERATOR_SECRET}
    path = tmp_path / "secret"
    path.write_text(OPERATOR_SECRET + "\n")
    path.chmod(0o600)
    return {"ORCA_LAB_SECRET_FILE": str(path)}


@pytest.mark.parametrize("how", ["env", "file"])
def test_torchrun_takes_the_operators_secret_and_the_store_never_holds_it(how, tmp_path):
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = _secret_env(how, tmp_path)
    procs = [start_rank(r, agent.port, tmp_path, "--n-requests", "2", "--scale", "0.05",
                        *(["--out", str(tmp_path)] if r == 0 else []), secret=env) for r in (0, 1)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
        assert (tmp_path / "torchrun.json").exists()
        values = b"".join(agent.get(k) for k in agent.list_keys())
        assert agent.list_keys() and OPERATOR_SECRET.encode() not in values
        assert not [k for k in agent.list_keys() if "secret" in k]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.parametrize("env,match", [
    ({}, r"no control secret: set ORCA_LAB_SECRET \(or ORCA_LAB_SECRET_FILE"),
    ({"ORCA_LAB_SECRET": "short"}, r"ORCA_LAB_SECRET holds 5 characters; a control secret has at least 32"),
    ({"ORCA_LAB_SECRET_FILE": "/nonexistent/secret"}, r"ORCA_LAB_SECRET_FILE=/nonexistent/secret cannot be read"),
    ({"ORCA_LAB_SECRET": OPERATOR_SECRET, "ORCA_LAB_SECRET_FILE": "/x"},
     r"both ORCA_LAB_SECRET and ORCA_LAB_SECRET_FILE"),
], ids=["none", "short", "unreadable", "both"])
def test_torchrun_refuses_to_start_without_a_good_secret(env, match):
    """Refused before the rendezvous: no store is ever reached (the port here has none)."""
    done = _rank0_without_a_store([], env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.search(match, done.stderr), done.stderr[-3000:]
    assert OPERATOR_SECRET not in done.stderr


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_secret_file_its_group_or_others_may_open_is_refused(tmp_path, mode):
    """Operator-only, as ssh wants a private key: the file, its mode and the command that fixes it."""
    from orca_lab.torchrun import operator_secret
    path = tmp_path / "secret"
    path.write_text(OPERATOR_SECRET + "\n")
    path.chmod(mode)
    with pytest.raises(ValueError, match=rf"ORCA_LAB_SECRET_FILE={path} has mode {mode:04o}: .* run chmod 600 {path}$"):
        operator_secret({"ORCA_LAB_SECRET_FILE": str(path)})
    path.chmod(0o600)
    assert operator_secret({"ORCA_LAB_SECRET_FILE": str(path)}) == OPERATOR_SECRET.encode()


@pytest.mark.parametrize("args, match", [
    (["--checkpoint", "/nonexistent/ckpt"], r"/nonexistent/ckpt is not a checkpoint directory"),
    (["--max-bs", "0"], r"max_bs=0 is out of range"),
    (["--model", "gpt3-999b"], r"gpt3-999b"),
    (["--systems", "orca,vllm"], r"system='vllm' is not allowed: choose one of 'orca', 'ft'"),
], ids=["checkpoint", "max_bs", "model", "systems"])
def test_torchrun_refuses_bad_settings_before_the_rendezvous(args, match):
    """Refused with the field named, before any store is reached (the port here has none)."""
    done = _rank0_without_a_store(args, {"ORCA_LAB_SECRET": OPERATOR_SECRET})
    assert done.returncode == 2 and re.search(match, done.stderr), done.stderr[-3000:]


def _rank0_without_a_store(args, env):
    """``python -m orca_lab.torchrun`` as rank 0 of a 1 x 2 world whose store port (9) has none."""
    return subprocess.run([sys.executable, "-m", "orca_lab.torchrun", "--pp", "2", "--device", "cpu", *args],
                          env=dict(_without_secret(), RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT="9", PYTHONPATH=str(Path(__file__).resolve().parents[1]), **env),
                          capture_output=True, text=True, timeout=120)
