"""The benchmark scripts refuse a number out of range where it enters: exit status 2 and a message
naming the flag, the value given and the allowed range, before anything is built or measured (each
case here ends in argparse; no benchmark runs). ``--smoke`` keeps the flags given, so a bad one given
with it is refused too."""
import pytest

from test_perf_smoke import load

CASES = [   # script, argv, what the message must hold: the flag and its value, the allowed range
    ("detokenization", ["--lengths", "0"], "--lengths=0", "allowed [1, inf]"),
    ("detokenization", ["--lengths", "64", "-5"], "--lengths=-5", "allowed [1, inf]"),
    ("detokenization", ["--min-tokens", "-1"], "--min-tokens=-1", "allowed [1, inf]"),
    ("detokenization", ["--repeats", "0"], "--repeats=0", "allowed [1, inf]"),
    ("generate_overhead", ["--rounds", "0"], "--rounds=0", "allowed [1, inf]"),
    ("generate_overhead", ["--threads", "0"], "--threads=0", "allowed [1, inf]"),
    ("generate_overhead", ["--smoke", "--n-slots", "5"], "--n-slots=5", "allowed [17, 2147483648]"),
    ("generate_overhead", ["--smoke", "--rounds", "0"], "--rounds=0", "allowed [1, inf]"),
    ("select_scaling", ["--steps", "0"], "--steps=0", "allowed [1, inf]"),
    ("select_scaling", ["--max-bs", "0"], "--max-bs=0", "allowed [1, 65536]"),
    ("select_scaling", ["--waiting", "-1"], "--waiting=-1", "allowed [0, 10000000]"),
    ("select_scaling", ["--smoke", "--steps", "0"], "--steps=0", "allowed [1, inf]"),
    ("step_time", ["--threads", "0"], "--threads=0", "allowed [1, inf]"),
    ("step_time", ["--smoke", "--input", "0"], "--input=0", "allowed [1, 524288]"),
    ("step_time", ["--smoke", "--batch-sizes", "0"], "--batch-sizes=0", "allowed [1, 65536]"),
    ("step_time", ["--smoke", "--output", "1"], "--output=1", "allowed >= 2"),
    ("step_time", ["--input", "8", "--output", "4", "--max-seq-len", "11"], "--max-seq-len=11", "allowed [12, 1048576]"),
    ("overhead", ["--smoke", "--iters", "0"], "--iters=0", "allowed [1, inf]"),
    ("overhead", ["--smoke", "--scale", "-1"], "--scale=-1.0", "allowed [0.001, 1000.0]"),
    ("overhead", ["--scale", "nan"], "--scale=nan", "finite number in [0.001, 1000.0]"),
    ("peer_hf", ["--smoke", "--rounds", "0"], "--rounds=0", "allowed [1, inf]"),
    ("peer_hf", ["--smoke", "--n-requests", "0"], "--n-requests=0", "allowed [1, 10000000]"),
    ("peer_hf", ["--scale", "0"], "--scale=0.0", "allowed [0.001, 1000.0]"),
    ("peer_hf", ["--threads", "0"], "--threads=0", "allowed [1, inf]"),
    ("prefix_caching", ["--smoke", "--rounds", "0"], "--rounds=0", "allowed [1, inf]"),
    ("prefix_caching", ["--rate", "0"], "--rate=0.0", "allowed (0.0, inf]"),
    ("prefix_caching", ["--block-size", "48"], "--block-size=48", "divisor of --n-slots=16384"),
]


@pytest.mark.parametrize("script, argv, flag, allowed", CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_an_argument_out_of_range_is_refused_naming_its_flag_and_range(script, argv, flag, allowed, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        load(script).main([*argv, "--out", str(tmp_path / "never.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and allowed in err and "Traceback" not in err, err
    assert not (tmp_path / "never.json").exists()


def test_smoke_keeps_a_flag_given_and_sets_the_rest(monkeypatch):
    """--smoke's toy size is the default of what was not given: a value given is the one run."""
    bench, got = load("overhead"), {}

    def stop(args):                     # the parsed arguments, before anything is built
        got.update(vars(args))
        raise SystemExit(0)
    monkeypatch.setattr(bench, "check_args", stop)
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--iters", "7"])
    assert (got["iters"], got["batch_sizes"], got["scale"]) == (7, [1, 4], 0.05)


def test_prefix_caching_says_why_it_exits_as_it_does(capsys):
    bench = load("prefix_caching")
    assert bench.verdict(1.01, smoke=True) == 0
    assert "checked at full size only" in capsys.readouterr().out
    assert bench.verdict(1.01, smoke=False) == 1
    assert "NOT met" in capsys.readouterr().out
    assert bench.verdict(2.5, smoke=False) == 0
