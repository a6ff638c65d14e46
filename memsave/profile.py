"""Measure peak memory of one step (and estimate it before running).

The figure is the allocator's peak above the pre-step baseline, from
``tf.config.experimental.get_memory_info``. On CPU it is repeatable (about 1%
for Session runs) with the BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``,
read when the TensorFlow runtime starts) and one inter-op thread, which fixes
the execution order.
"""

import collections
import dataclasses
import glob
import logging
import os
import tempfile

import tensorflow as tf

from memsave import tf_internal
from memsave.log import warn_once

logger = logging.getLogger("memsave")

ENV_HINT = ("set TF_CPU_ALLOCATOR_USE_BFC=true in the environment before TensorFlow "
            "runs its first op")


def default_device():
    """'GPU:0' when a GPU is visible, else 'CPU:0'."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def memory_info(device=None):
    """``{'current': bytes, 'peak': bytes}`` for ``device``, or a clear error."""
    device = device or default_device()
    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError) as e:
        raise RuntimeError("memsave.profile: no allocator statistics for %s (%s); %s"
                           % (device, e, ENV_HINT)) from None
    if device.startswith("CPU") and os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() != "true":
        warn_once("profile:bfc", "memsave.profile: TF_CPU_ALLOCATOR_USE_BFC is not 'true'; "
                  "CPU peaks come from the default allocator and are less repeatable; "
                  + ENV_HINT)
    return info


def peak_memory(step, *args, device=None, warmup=1, **kwargs):
    """Peak bytes allocated above the pre-step baseline during one ``step``.

    ``step`` is any callable (``sess.run`` with its fetches bound, a
    ``tf.function``, ...); it is called ``warmup`` times first so that graph
    building, tracing and Grappler do not count, then once measured.
    """
    if not callable(step):
        raise TypeError("peak_memory needs a callable step, got %r" % (step,))
    for _ in range(warmup):
        step(*args, **kwargs)
    return measured_call(step, *args, device=device, **kwargs)[1]


def measured_call(step, *args, device=None, **kwargs):
    """``(step(*args, **kwargs), peak bytes above the pre-call baseline)``: one
    call, measured (RuntimeError without allocator statistics)."""
    device = device or default_device()
    memory_info(device)
    tf.config.experimental.reset_memory_stats(device)
    base = memory_info(device)["current"]
    result = step(*args, **kwargs)
    peak = memory_info(device)["peak"] - base
    logger.debug("memsave.profile: peak %d bytes above a baseline of %d on %s", peak, base, device)
    return result, peak


@dataclasses.dataclass(frozen=True)
class PeakBreakdown:
    """What was allocated at the peak of one call (see :func:`peak_breakdown`).

    ``peak``: bytes above the pre-call baseline, as :func:`peak_memory`
    measures. ``at``: the op whose allocation reached it (None where no op is
    named). ``live``: ``(op, kind, bytes, count)`` of the allocations made
    during the call and alive at the peak, largest first; ``kind`` is the
    allocator's region ('output', 'temp', ...), op and kind are None for
    buffers no op is named for: scratch some kernels allocate outside their
    op's annotation, and the buffers of XLA-compiled calls. ``unnamed``:
    their bytes. ``scratch``: ``(op, bytes)`` over the whole call, largest
    first: the most each op held at once beyond its outputs (its
    temporaries, less those it handed on as outputs; an unnamed buffer
    counts for the last op named before it).
    ``slack``: bytes of the live chunks beyond what their ops asked for: the
    BFC allocator hands out a free chunk whole when it is under twice the
    request, so a 4 MiB tensor can hold a 7.6 MiB chunk, depending on what
    the kernels before it freed (their scratch differs between CPUs).
    """

    peak: int
    at: object
    live: tuple
    unnamed: int
    scratch: tuple = ()
    slack: int = 0

    def summary(self, top=10):
        mib = 2 ** 20
        lines = ["peak %.1f MiB above the baseline, reached by %s"
                 % (self.peak / mib, self.at or "an allocation no op is named for")]
        for op, kind, nbytes, count in self.live[:top]:
            lines.append("  %9.2f MiB  %s%s%s" % (
                nbytes / mib, op or "(no op: kernel scratch or an XLA call's buffers)",
                " [%s]" % kind if kind else "", " x%d" % count if count > 1 else ""))
        if len(self.live) > top:
            rest = sum(row[2] for row in self.live[top:])
            lines.append("  %9.2f MiB  %d more" % (rest / mib, len(self.live) - top))
        if self.slack:
            lines.append("  of which %.2f MiB chunk slack (chunks larger than asked for)"
                         % (self.slack / mib))
        return "\n".join(lines)


def peak_breakdown(step, *args, device=None, warmup=1, **kwargs):
    """Run ``step`` once under TensorFlow's profiler and say what was live at its peak.

    Where :func:`peak_memory` gives one figure, this names the tensors and
    scratch behind it, from the allocator events of the profiler's trace,
    for the case where a peak is higher than expected (a plan's estimate, a
    budget). ``step`` is called ``warmup`` times first, as for
    :func:`peak_memory`. The profiler is process-wide: not while another
    trace is running.
    """
    if not callable(step):
        raise TypeError("peak_breakdown needs a callable step, got %r" % (step,))
    for _ in range(warmup):
        step(*args, **kwargs)
    return profiled_call(step, *args, device=device, **kwargs)[1]


def profiled_call(step, *args, device=None, strict=True, **kwargs):
    """``(step(*args, **kwargs), its PeakBreakdown)``: one call under the
    profiler. Where the profiler cannot start or its trace has no allocations,
    a RuntimeError, or with ``strict=False`` the step run without it and None
    for the breakdown (logged)."""
    device = device or default_device()
    base = memory_info(device)["current"]

    def unavailable(why):
        if strict:
            raise RuntimeError("memsave.profile: %s" % why)
        logger.debug("memsave.profile: no breakdown: %s", why)

    with tempfile.TemporaryDirectory(prefix="memsave-profile-") as logdir:
        try:
            tf.profiler.experimental.start(logdir)
        except (tf.errors.OpError, RuntimeError) as e:
            unavailable("the profiler did not start (%s)" % e)
            return step(*args, **kwargs), None
        try:
            result = step(*args, **kwargs)
        finally:
            tf.profiler.experimental.stop()
        paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        space = tf_internal.XSpace()
        if paths:
            with open(paths[0], "rb") as f:
                space.ParseFromString(f.read())
    events = _allocation_events(space, device)
    if not events:
        unavailable("the trace has no allocations on %s; %s" % (device, ENV_HINT))
        return result, None
    return result, _at_peak(events, base)


def _allocator_of(device):
    """A test on allocator names: those of ``device`` ('GPU:1' -> 'GPU_1_bfc')."""
    kind, _, index = device.upper().rpartition("/DEVICE:")[2].partition(":")
    if kind == "GPU":
        name = "GPU_%s_bfc" % (index or "0")
        return lambda allocator: allocator == name
    return lambda allocator: "cpu" in allocator.lower()


def _allocation_events(space, device):
    """``(time, allocated?, stats)`` of ``device``'s allocator events, in time order."""
    mine = _allocator_of(device)
    events = []
    for plane in space.planes:
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        kinds = {k: v.name for k, v in plane.event_metadata.items()
                 if v.name in ("MemoryAllocation", "MemoryDeallocation")}
        for line in plane.lines:
            for event in line.events:
                if event.metadata_id not in kinds:
                    continue
                stats = {}
                for stat in event.stats:
                    value = getattr(stat, stat.WhichOneof("value"))
                    if stat.WhichOneof("value") == "ref_value":
                        value = plane.stat_metadata[value].name
                    stats[stat_names[stat.metadata_id]] = value
                if mine(stats.get("allocator_name", "")):
                    allocated = kinds[event.metadata_id] == "MemoryAllocation"
                    stats[_THREAD] = line.id   # a line is a thread: it runs one kernel at a time
                    events.append((line.timestamp_ns * 1000 + event.offset_ps, allocated, stats))
    events.sort(key=lambda e: e[0])
    return events


# The thread an allocator event came from, added to its stats.
_THREAD = "_thread"


def _outlives_its_op(events):
    """Indices of the allocations in ``events`` that are not their op's
    scratch though allocated as such: a temporary the kernel handed on as its
    output (Einsum's; attention's scores then live, forwarded through the
    softmax, until the backward pass), which is still held when the next op
    on its thread allocates, and anything still held when the call ends."""
    open_temps, held, handed_on = collections.defaultdict(dict), {}, set()
    for i, (_, allocated, stats) in enumerate(events):
        addr, thread = stats["addr"], stats.get(_THREAD)
        if not allocated:
            held.pop(addr, None)
            for temps in open_temps.values():
                temps.pop(addr, None)
            continue
        held[addr] = i
        op, kind = stats.get("tf_op") or None, stats.get("region_type") or None
        if op is None:
            continue
        temps = open_temps[thread]
        for other, (j, owner) in list(temps.items()):
            if owner != op:
                handed_on.add(j)
                del temps[other]
        if kind != "output":
            temps[addr] = (i, op)
    return handed_on | set(held.values())


def _at_peak(events, base):
    """The :class:`PeakBreakdown` of allocator ``events`` above ``base`` bytes."""
    live, peak, at, at_peak, named_last = {}, None, None, {}, None
    scratch, most = collections.Counter(), collections.Counter()   # per op: now, at most
    not_scratch = _outlives_its_op(events)
    for i, (_, allocated, stats) in enumerate(events):
        addr = stats["addr"]
        if allocated:
            op, kind = stats.get("tf_op") or None, stats.get("region_type") or None
            # An unnamed buffer is the scratch of the last op named before it.
            owner = ((op or named_last) if (op is None or kind != "output")
                     and i not in not_scratch else None)
            live[addr] = (op, kind, int(stats["allocation_bytes"]), owner,
                          int(stats.get("requested_bytes", stats["allocation_bytes"])))
            named_last = op or named_last
            if owner is not None:
                scratch[owner] += live[addr][2]
                most[owner] = max(most[owner], scratch[owner])
        else:
            gone = live.pop(addr, None)   # None: allocated before the call (the baseline)
            if gone is not None and gone[3] is not None:
                scratch[gone[3]] -= gone[2]
        in_use = int(stats["bytes_allocated"])
        if peak is None or in_use > peak:
            peak, at_peak = in_use, dict(live)
            at = (stats.get("tf_op") or None) if allocated else None
    grouped = collections.defaultdict(lambda: [0, 0])
    slack = sum(max(0, nbytes - asked) for _, _, nbytes, _, asked in at_peak.values())
    for op, kind, nbytes, _, _ in at_peak.values():
        grouped[(op, kind)][0] += nbytes
        grouped[(op, kind)][1] += 1
    rows = sorted(((op, kind, n, c) for (op, kind), (n, c) in grouped.items()),
                  key=lambda row: (-row[2], row[0] or "", row[1] or ""))
    unnamed = sum(n for op, _, n, _ in rows if op is None)
    by_op = tuple(sorted(((op, n) for op, n in most.items() if n > 0 and op is not None),
                         key=lambda item: (-item[1], item[0])))
    return PeakBreakdown(peak=max(0, peak - base), at=at, live=tuple(rows), unnamed=unnamed,
                         scratch=by_op, slack=slack)


def session_step(session, fetches, feed_dict=None):
    """A callable running ``fetches`` once in ``session`` (for ``peak_memory``)."""
    def step():
        session.run(fetches, feed_dict=feed_dict)
    return step


def configure_for_measurement():
    """Set the allocator and threading the meter needs.

    Call it before the first TensorFlow op runs: both settings are read when
    the runtime starts. Returns False (and logs) if that was too late.
    """
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        logger.warning("memsave.profile: TensorFlow is already initialized; "
                       "inter-op threads stay as they are")
        return False
    return True


def estimate_peak(ys, xs, checkpoints="optimal", **plan_kwargs):
    """Estimated peak bytes of the backward pass, before running it.

    ``checkpoints=None`` estimates plain ``tf.gradients``. The estimate
    simulates the rewrite's schedule on the planning graph (see
    :mod:`memsave.planning.simulate`); it counts activations, their gradients
    and the weight gradients (pieces and sums), not the weights themselves.
    """
    from memsave.api import plan  # pylint: disable=import-outside-toplevel
    if checkpoints is None:
        return plan(ys, xs, checkpoints=[], **plan_kwargs).plain_peak_bytes
    return plan(ys, xs, checkpoints=checkpoints, **plan_kwargs).estimated_peak_bytes
