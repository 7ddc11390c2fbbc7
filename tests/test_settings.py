"""A run's settings are decided in one place, once (STYLE.md rule 15): cli.py turns the flags into plain values and a
frozen config, and nothing below train.main receives the flags, as an argparse.Namespace or as a dict to pick keys
from; each function takes the values it needs.

The test runs short tiny AOC runs under sys.setprofile, one with the held-out check and its --resume, and looks at the
arguments of every call of a project function (one defined in a top-level module of the repository): none outside
cli.py and train.main may receive a Namespace, or a dict holding two flag names or more (a log row's "lr" alone is no
copy of the flags), as an argument or as a field of a dataclass it is given (a dict kept in an object is passed all
the same). The one function that writes the record to disk, checkpoint.save_checkpoint, receives it: that is its job.
"""

import argparse
import dataclasses
import inspect
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import checkpoint  # noqa: E402
import cli  # noqa: E402
import presets  # noqa: E402
import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {str(p) for p in ROOT.glob("*.py")}   # the top-level modules
# the run's flags (the compressor's are its config's fields: a dict of those is a config, not the flags)
FLAGS = {a.dest for a in cli.build_parser()._actions if a.dest != "help"} - set(cli.COMPRESSOR_FLAGS)
WRITER = "checkpoint.save_checkpoint"   # writes the record (args.json, train_state.pt)
pytestmark = pytest.mark.usefixtures("one_thread")


def the_flags(value) -> bool:
    """Does `value` carry the run's flags: a Namespace, or a dict with two flag names or more?"""
    return isinstance(value, argparse.Namespace) or (isinstance(value, dict) and len(FLAGS & set(value)) >= 2)


def carries_flags(value) -> bool:
    """`value` carries the flags, itself or in a field (a dataclass's: a dict kept in an object)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return the_flags(value) or any(the_flags(getattr(value, f.name)) for f in dataclasses.fields(value))
    return the_flags(value)


@contextmanager
def calls_given_the_flags():
    """Every call of a project function below train.main, outside cli.py and the record's writer, that receives the
    flags: the list it yields fills while the block runs."""
    seen = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_filename not in PROJECT:
            return
        name = f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_qualname}"
        if name.startswith("cli.") or name in ("train.main", WRITER):
            return
        info = inspect.getargvalues(frame)
        given = [info.locals[a] for a in info.args if a in info.locals]
        given += list(info.locals.get(info.varargs) or ()) + list((info.locals.get(info.keywords) or {}).values())
        if any(carries_flags(v) for v in given):
            seen.append(name)

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


@dataclasses.dataclass
class Holder:
    record: dict


def test_the_checker_sees_the_flags_as_an_argument_and_as_a_field():
    flags = {"eval_data": None, "objective": "ae", "max_len": 16}
    with calls_given_the_flags() as seen:
        presets.readonly(args=argparse.Namespace(objective="ae"))
        presets.readonly(train_args=flags)
        presets.readonly(run=Holder(flags))
        presets.readonly(lr=1e-3, row={"step": 1, "lr": 1e-3}, run=Holder({}))   # a log row's one flag name: fine
    assert seen == ["presets.readonly"] * 3


def test_nothing_below_main_receives_the_flags(tmp_path, device):
    """A one-step tiny AOC run, and one with a held-out check every step, stopped and resumed: no project function
    below train.main (cli.py aside) receives the flags; the writer gets the record, which holds the config's fields
    and the resolved recipe."""
    common = ["--method", "aoc", "--mem", "4", "--batch-size", "2", "--device", str(device)]
    with calls_given_the_flags() as seen:
        train.main([*common, "--steps", "1", "--eval-every", "0", "--out", str(tmp_path / "plain")])
        out = str(tmp_path / "checked")
        train.main([*common, "--steps", "2", "--stop-after", "1", "--eval-every", "1", "--eval-n", "4", "--out", out])
        train.main(["--resume", out, "--device", str(device)])
    assert not seen, f"these receive the flags: {sorted(set(seen))}"
    record = checkpoint.read_train_state(out)["args"]
    assert (record["mem"], record["carrier"], record["objective"], record["eval_every"]) == (4, "kv", "ae", 1)
