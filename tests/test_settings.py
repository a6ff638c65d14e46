"""One way to say it: every entry point takes the same keywords, checked when it is called."""

import pathlib
import re

import keras
import pytest
import tensorflow as tf

import memsave
import memsave.keras
from memsave import patching, profile, settings
from memsave.planning import OffloadModel

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Each entry point called with one extra keyword. Nothing else is valid
# either (ys=None, a string for a model): an error about them would mean
# graph work started before the keywords were checked.
ENTRY_POINTS = {
    "memsave.gradients": lambda **kw: memsave.gradients(None, None, **kw),
    "memsave.gradients_memory": lambda **kw: memsave.gradients_memory(None, None, **kw),
    "memsave.plan": lambda **kw: memsave.plan(None, None, **kw),
    "memsave.GradientTape": lambda **kw: memsave.GradientTape(**kw),
    "memsave.patch": lambda **kw: memsave.patch(**kw),
    "memsave.patching.scope": lambda **kw: patching.scope(**kw),
    "memsave.keras.enable": lambda **kw: memsave.keras.enable("not a model", **kw),
    "memsave.plan via estimate_peak": lambda **kw: profile.estimate_peak(None, None, **kw),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_misspelled_keyword_is_a_type_error_naming_it(entry):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'budgte' \(did you "
                                        r"mean 'budget'\?\)"):
        ENTRY_POINTS[entry](budgte=0.5)
    assert patching.current() is None


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_bad_value_is_refused_at_the_call(entry):
    with pytest.raises(ValueError, match="budget"):
        ENTRY_POINTS[entry](budget="half")
    with pytest.raises(TypeError, match="fallback must be True or False"):
        ENTRY_POINTS[entry](fallback="store")
    if entry != "memsave.gradients_memory":   # its checkpoints= is fixed
        with pytest.raises(ValueError, match="unknown checkpoints strategy"):
            ENTRY_POINTS[entry](checkpoints="fastest")
    assert patching.current() is None


def test_moved_offload_keywords_say_where_they_went():
    with pytest.raises(TypeError, match=r"offload_model=memsave.OffloadModel\(swapin_ahead="):
        memsave.GradientTape(swapin_ahead=0)


def test_tf_gradients_keywords_pass_and_are_suggested():
    with pytest.raises(TypeError, match="did you mean 'stop_gradients'"):
        memsave.gradients(None, None, stop_gradient=[])


def test_budget_in_bytes_sizes_and_fractions():
    def budget(value):
        return settings.resolve("optimal", {"budget": value}, "test").budget

    assert budget("6GiB") == 6 * 2**30
    assert budget("800MB") == 800e6
    assert budget("1.5 gib") == 1.5 * 2**30
    assert budget("4096") == 4096
    assert budget(0.5) == 0.5 and budget(2**20) == 2**20
    for bad in ("6 parsecs", "", 0, -1, float("inf"), float("nan"), "inf GiB"):
        with pytest.raises(ValueError, match="budget"):
            budget(bad)
    for bad in (True, [1], b"6GiB"):   # found by a helper: a ValueError said "> 0"
        with pytest.raises(TypeError, match="budget must be a number"):
            budget(bad)


def test_the_settings_object_is_what_everything_reads():
    tape = memsave.GradientTape(checkpoints="speed", budget=None, min_checkpoint_size=0,
                                offload="auto", offload_model=OffloadModel(swapin_ahead=0))
    resolved = tape._memsave_settings   # pylint: disable=protected-access
    assert resolved.checkpoints.label == "speed" and resolved.checkpoints.by_name
    assert resolved.min_checkpoint_size == 0 and resolved.offload == "auto"
    assert resolved.offload_model.prefetch is False
    assert settings.resolve("collection", {}, "test").checkpoints.by_name
    listed = settings.resolve([tf.constant(1.0)], {}, "test").checkpoints
    assert listed.label == "list" and not listed.by_name and len(listed.tensors) == 1
    with pytest.raises(ValueError, match="budget= needs checkpoints='optimal'"):
        settings.resolve("collection", {"budget": 0.5}, "test")


def test_the_old_strategy_keyword_warns_everywhere():
    with pytest.warns(DeprecationWarning, match="checkpoints="):
        tape = memsave.GradientTape(strategy="memory")
    assert tape.checkpoints == "memory"
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.warns(DeprecationWarning, match="checkpoints="):
        memsave.keras.enable(model, strategy="speed")
    memsave.keras.disable(model)


def test_docs_list_the_parameters_once_in_their_order():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("## Parameters", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)=` \|", section, re.M)
    assert tuple(rows) == settings.PARAMETERS
