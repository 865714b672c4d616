"""The pieces of a split model that need no second process (issue 16): the hosts file and its one-line errors, the
layer split, which weights a stage reads, and the control channel's heartbeat. tests/test_distributed_load.py loads
stages; tests/test_distributed_procs.py runs real processes over the ring."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from mlxchat.app.cli import main
from mlxchat.core.distributed import HostsError, read_hosts
from mlxchat.core.distributed.channel import Link
from mlxchat.core.distributed.common import layer_weights
from mlxchat.core.model.split import Stage, check_tensor_parallel, split_layers


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, expected", [
    ("not json", "not JSON"),
    ('[["127.0.0.1:5000"]]', "at least 2 ranks"),
    ('{"a": 1}', "at least 2 ranks"),
    ('[["127.0.0.1:5000"], []]', "rank 1 must be a non-empty list"),
    ('[["127.0.0.1:5000"], ["127.0.0.1"]]', 'rank 1 has "127.0.0.1", not "host:port"'),
    ('[["127.0.0.1:5000"], ["127.0.0.1:99999"]]', "port from 1 to 65535"),
    ('[["127.0.0.1:5000"], [5001]]', 'rank 1 has 5001, not "host:port"'),
])
def test_bad_hosts_files_name_the_flag_and_the_problem(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(HostsError, match=f"^--hosts {path}: .*") as e:
        read_hosts(path)
    assert expected in str(e.value)


def test_hosts_file_and_control_port(tmp_path: Path) -> None:
    hosts = read_hosts(write(tmp_path, '[["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.0.0.3:5000"]]'))
    assert hosts.size == 3 and hosts.address(2) == "10.0.0.3:5000"
    assert hosts.control_address() == ("127.0.0.1", 5002)  # above every port of rank 0's host
    assert hosts.control_address(7000) == ("127.0.0.1", 7000)
    with pytest.raises(HostsError, match="--rank 3: a worker's rank must be 1 to 2"):
        hosts.check_rank(3)
    with pytest.raises(HostsError, match="--rank 0: .*rank 0 is the app"):
        hosts.check_rank(0)


@pytest.mark.parametrize("argv, expected", [
    (["worker", "--hosts", "{hosts}", "--rank", "5"], "--rank 5: a worker's rank must be 1 for the 2 ranks"),
    (["worker", "--hosts", "{missing}", "--rank", "1"], "--hosts {missing}: no such file"),
    (["generate", "hi", "--hosts", "{missing}"], "--hosts {missing}: no such file"),
    (["generate", "hi", "--hosts", "{hosts}", "--connect-timeout", "0"], "--connect-timeout must be greater than 0"),
    (["chat", "--hosts", "{hosts}", "--control-port", "70000"], "--control-port must be between 1 and 65535"),
])
def test_bad_split_flags_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str],
                                      expected: str) -> None:
    names = {"hosts": str(write(tmp_path, '[["127.0.0.1:5000"], ["127.0.0.1:5001"]]')),
             "missing": str(tmp_path / "nope.json")}
    assert main([a.format(**names) for a in argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mlxchat: error: {expected.format(**names)}"), lines


def test_layers_split_by_free_memory() -> None:
    assert split_layers(30, [1, 1]) == [15, 15]
    assert split_layers(30, [2, 1]) == [20, 10]
    assert split_layers(5, [1, 1, 1]) == [2, 2, 1]
    assert split_layers(30, [1, 1, 1, 100]) == [1, 1, 1, 27]  # every rank runs at least one layer
    with pytest.raises(ValueError, match="2 layers, fewer than the 3 ranks"):
        split_layers(2, [1, 1, 1])
    assert layer_weights([100, 105]) == [1.0, 1.0]  # near-equal machines split evenly (two ranks of one machine)
    assert layer_weights([100, 300]) == [100.0, 300.0]


def test_tensor_parallel_needs_heads_divisible_by_the_ranks() -> None:
    check_tensor_parallel(9, 3, 3)
    with pytest.raises(ValueError, match="divide by the 2 ranks, but the model has 9 query and 3 key/value heads"):
        check_tensor_parallel(9, 3, 2)


def test_a_stage_reads_only_its_weights() -> None:
    first, last = Stage(1, (15, 15)), Stage(0, (15, 15))  # mlx-lm's order: rank 0 runs the last layers
    assert (first.start, first.end, last.start, last.end) == (0, 15, 15, 30)
    assert first.keeps("model.layers.14.mlp.up_proj.weight", tied=True)
    assert not first.keeps("model.layers.15.mlp.up_proj.weight", tied=True)
    assert first.keeps("model.embed_tokens.weight", tied=True) and not first.keeps("model.norm.weight", tied=True)
    assert last.keeps("model.norm.weight", tied=True) and last.keeps("lm_head.weight", tied=False)
    assert last.keeps("model.embed_tokens.scales", tied=True)  # a tied head is the embedding matrix
    assert not last.keeps("model.embed_tokens.weight", tied=False)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        b = socket.create_connection(server.getsockname())
        a, _ = server.accept()
    return a, b


def _pair(timeout_s: float) -> tuple[Link, socket.socket, list[str], threading.Event]:
    a, b = tcp_pair()
    lost: list[str] = []
    done = threading.Event()
    link = Link(a, lambda m: None, lambda why: (lost.append(why), done.set()), timeout_s=timeout_s)
    link.start()
    return link, b, lost, done


def test_a_silent_peer_is_lost_after_the_timeout() -> None:
    started = time.monotonic()  # the link counts from its creation
    link, peer, lost, done = _pair(timeout_s=1.0)
    assert done.wait(5)
    assert 1.0 <= time.monotonic() - started < 3 and "sent nothing for 1 s" in lost[0]
    link.close()
    peer.close()


def test_a_closed_peer_is_lost_at_once_and_messages_arrive_in_order() -> None:
    a, b = tcp_pair()
    got: list[dict] = []
    lost = threading.Event()
    link = Link(a, got.append, lambda why: lost.set(), received=b'{"op":"x","n":1}\n')
    link.start()
    b.sendall(json.dumps({"op": "x", "n": 2}).encode() + b"\n" + b'{"op":"ping"}\n')
    time.sleep(0.3)
    b.close()
    assert lost.wait(2)
    assert got == [{"op": "x", "n": 1}, {"op": "x", "n": 2}]  # pings are not passed on
    link.close()


def test_bench_split_summary() -> None:
    from mlxchat.bench.split import summary_lines

    memory = {"weight_bytes": 62 << 20, "active_bytes": 70 << 20, "peak_bytes": 81 << 20}
    section = {"max_tokens": 32, "repeats": 1, "greedy_tokens_equal": True, "overhead_ms_per_token": 3.0,
               "largest_rank_weights_vs_one": 0.66,
               "one_process": {"decode_tokens_per_s": 20.0, "tpot_ms": 50.0, "ttft_s": 0.5, "peak_bytes": 118 << 20,
                               "weight_bytes": 94 << 20},
               "split": {"decode_tokens_per_s": 18.9, "tpot_ms": 53.0, "ttft_s": 0.9, "peak_bytes": 81 << 20,
                         "split": [15, 15], "ranks": {"0": memory, "1": memory}}}
    text = "\n".join(summary_lines(section))
    assert "layers [15, 15]" in text and "+3.0 ms/token" in text and "rank 1 62 MiB weights / 81 MiB peak" in text
    assert summary_lines(None) == []


def test_the_plan_carries_the_policy_asked_for_and_each_rank_resolves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the native kernel runs is a fact of each machine: a rank 0 without it resolves "auto" to "fallback",
    which no machine can load by name (it failed every worker under MLXCHAT_NATIVE=0). The plan sends what was asked
    for, and a worker loads it on its own terms."""
    from mlxchat.core.model import loader
    from mlxchat.core.distributed.common import Plan

    monkeypatch.setenv("MLXCHAT_NATIVE", "0")
    monkeypatch.delenv("MLXCHAT_WEIGHTS", raising=False)
    assert loader.resolve_policy(None) == "fallback"
    plan = Plan.of(json.loads(json.dumps(Plan(None, loader.requested_policy(None), "pipeline", (15, 15)).message())))
    assert plan.weights == "auto"
    assert loader.resolve_policy(plan.weights) == "fallback"  # the worker's own decision, no ValueError
    monkeypatch.setenv("MLXCHAT_WEIGHTS", "dequantize")
    assert loader.requested_policy(None) == "dequantize" and loader.requested_policy("native") == "native"


RING_NOISE = r'''
import logging, os, sys
logging.basicConfig(format="%(message)s")  # as `mlxchat serve` sets up its log before it joins a ring
from mlxchat.core.distributed.ring_noise import quiet_ring_errors
quiet_ring_errors()
quiet_ring_errors()  # again: a no-op
os.write(2, b"[ring]")  # a log line between the ring's two writes must not carry "[ring]" past the filter
logging.getLogger("mlxchat.server").warning("POST /v1/chat/completions 500")
os.write(2, b" Socket 7 was closed by the peer\n")
os.write(2, b"[ring] Socket 5 was closed by the peer\n" * 10)  # what MLX's C++ writes on fd 2
os.write(2, b"[ri")
os.write(2, b"ng] Too many send/recv errors. Failing pending tasks...\n")
os.write(2, b"from C\n")
os.write(2, b"50%\r")
os.write(2, b"100%\n")
print("mlxchat: error: rank 1 failed", file=sys.stderr)
print(sys.stderr.isatty() == os.isatty(int(sys.argv[1])), flush=True)
os.write(2, b"terminate called without an active exception\n")
os._exit(3)  # as a split model's fault path leaves: what C wrote before still arrives
'''


def test_the_ring_backends_socket_errors_are_kept_off_stderr_and_the_rest_passes() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", RING_NOISE, "2"], capture_output=True, timeout=60)
    assert done.returncode == 3 and done.stdout == b"True\n"  # sys.stderr is still the terminal (or not) it was
    assert b"[ring]" not in done.stderr
    # Python's lines go straight to stderr, C's through the filter: each keeps its own order.
    lines = done.stderr.decode().split("\n")[:-1]
    assert lines.index("from C") < lines.index("50%\r100%") < lines.index(
        "terminate called without an active exception")
    assert "mlxchat: error: rank 1 failed" in lines and "POST /v1/chat/completions 500" in lines and len(lines) == 5
