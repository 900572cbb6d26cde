"""`convolab tune`: sweep every GPU rung's parameters per conv layer and cache the winners.

For each conv layer of the model and each GPU rung that supports the layer's shape, every
candidate parameter set (the cartesian product of the rung's `space`, capped) is first
CHECKED — output poisoned with NaN, relative L2 error against the fp64 reference on a few
images of the same layer, and again on the first images of the full-batch output — and only
then timed (CUDA events, warm-up, median). Winners are kept per (GPU name, layer shape,
dtype mode), where a mode (`precision.TUNE_MODES`) admits every rung whose promised tolerance
is at least as tight as the mode's own (`precision.TOLERANCE`).

The cache is one versioned JSON file: $CONVOLAB_CACHE/tune.json if that variable is set,
else $XDG_CACHE_HOME/convolab/tune.json (~/.cache/convolab/tune.json). A file of another
version, or one that does not parse, is reported with a warning and ignored — never
trusted — and is replaced on the next save. Saves are atomic (temporary file in the same
folder, then os.replace), so a crash never leaves a half-written cache, and `update_cache`
holds an exclusive lock (``tune.json.lock`` beside it) across its read-merge-write, so tuners
running at once never drop each other's entries.

Everything above the `main` section is pure Python and is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import itertools
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convolab import models
from convolab.fsutil import created_file_mode
from convolab.gpu.device import gpu_name
from convolab.precision import TOLERANCE, TUNE_MODES
from convolab.shapes import ConvShape

CACHE_VERSION = 1
CACHE_FILE = "tune.json"
# Rungs the tuner does not race: `auto` delegates to the others, and `streams` is about
# Layer Time (copies), not the Op Time the tuner measures.
NOT_TUNED: frozenset[str] = frozenset({"auto", "streams"})
DEFAULT_MAX_CANDIDATES = 16
CHECK_BATCH = 4
# A rung whose start (`start_params`) runs slower than this many times the fastest start among
# the rungs it competes with (those accurate enough for its own mode) is not searched, and a
# candidate whose first run already is that slow is not timed further: on VGG's layers the
# early rungs take 10-600 ms a run where the implicit GEMMs take 0.03-1.
SEARCH_WITHIN = 2.0


class CacheWarning(UserWarning):
    """The tune cache exists but cannot be trusted (corrupt, other version, bad entry)."""


# --------------------------------------------------------------------------------------
# Cache: location, entries, load/save (pure, tested on the CPU)
# --------------------------------------------------------------------------------------


def cache_dir() -> Path:
    override = os.environ.get("CONVOLAB_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "convolab"


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def mode_of(tolerance: float) -> str:
    """The tightest mode whose accuracy a rung with this tolerance meets."""
    for mode in TUNE_MODES:
        if tolerance <= TOLERANCE[mode]:
            return mode
    loosest = TUNE_MODES[-1]
    raise ValueError(f"tolerance {tolerance} is looser than every mode ({loosest}: "
                     f"{TOLERANCE[loosest]})")


def check_mode(mode: str) -> str:
    if mode not in TUNE_MODES:
        raise ValueError(f"unknown dtype mode {mode!r}: use one of {', '.join(TUNE_MODES)}")
    return mode


def mode_tolerance(mode: str) -> float:
    """The loosest tolerance a rung may promise and still race in `mode`."""
    return TOLERANCE[check_mode(mode)]


_SHAPE_FIELDS = ("B", "C", "H", "W", "M", "K", "S")


@dataclass(frozen=True)
class TuneEntry:
    """One cached winner: the fastest checked rung + parameters for (gpu, shape, mode)."""

    gpu: str
    shape: ConvShape
    mode: str
    impl: str
    params: dict[str, Any] = field(default_factory=dict)
    median_ms: float = math.nan
    rel_l2: float = math.nan
    date: str = ""

    @property
    def key(self) -> tuple[str, ConvShape, str]:
        return (self.gpu, self.shape, self.mode)

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "shape": {f: getattr(self.shape, f) for f in _SHAPE_FIELDS},
            "mode": self.mode,
            "impl": self.impl,
            "params": dict(self.params),
            "median_ms": self.median_ms,
            "rel_l2": self.rel_l2,
            "date": self.date,
        }

    @classmethod
    def from_json(cls, data: Any) -> TuneEntry:
        """Strict: anything missing or mistyped raises ValueError."""
        if not isinstance(data, dict):
            raise ValueError("entry is not an object")
        try:
            shape_d = data["shape"]
            shape = ConvShape(**{f: shape_d[f] for f in _SHAPE_FIELDS})
            gpu, mode, impl = data["gpu"], data["mode"], data["impl"]
            params = data.get("params", {})
        except (KeyError, TypeError) as err:
            raise ValueError(f"entry lacks a field: {err}") from None
        if not all(isinstance(v, str) and v for v in (gpu, impl)):
            raise ValueError("entry's gpu and impl must be non-empty strings")
        check_mode(mode)
        if not isinstance(params, dict):
            raise ValueError("entry's params must be an object")
        return cls(
            gpu=gpu,
            shape=shape,
            mode=mode,
            impl=impl,
            params=params,
            median_ms=float(data.get("median_ms", math.nan)),
            rel_l2=float(data.get("rel_l2", math.nan)),
            date=str(data.get("date", "")),
        )


def load_cache(path: Path | None = None) -> list[TuneEntry]:
    """The cached entries; [] (with a CacheWarning) for anything that cannot be trusted."""
    path = cache_path() if path is None else Path(path)
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        warnings.warn(
            f"tune cache {path} is unreadable ({err}); ignoring it", CacheWarning, stacklevel=2
        )
        return []
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        warnings.warn(
            f"tune cache {path} has version {found!r}, this convolab reads {CACHE_VERSION}; "
            "ignoring it (run `convolab tune` to rebuild)",
            CacheWarning,
            stacklevel=2,
        )
        return []
    raw = data.get("entries")
    if not isinstance(raw, list):
        warnings.warn(
            f"tune cache {path} has no entry list; ignoring it", CacheWarning, stacklevel=2
        )
        return []
    entries = []
    for i, item in enumerate(raw):
        try:
            entries.append(TuneEntry.from_json(item))
        except ValueError as err:
            warnings.warn(
                f"tune cache {path}: entry {i} ignored ({err})", CacheWarning, stacklevel=2
            )
    return entries


def save_cache(entries: Iterable[TuneEntry], path: Path | None = None) -> Path:
    """Write atomically: a temporary file beside the target, fsync, then os.replace."""
    path = cache_path() if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"version": CACHE_VERSION, "entries": [e.to_json() for e in entries]}
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, created_file_mode())  # mkstemp's 0600 is not what the user asked for
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterable[None]:
    """An exclusive flock on `path` + '.lock' (created beside it, never deleted: deleting it
    would let a waiter lock a file a newcomer no longer sees)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, created_file_mode())
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def update_cache(new: Iterable[TuneEntry], path: Path | None = None) -> Path:
    """Merge `new` into the cache on disk (new winners replace same-key ones) under the lock,
    so concurrent updates all survive; returns the cache path."""
    path = cache_path() if path is None else Path(path)
    new = list(new)
    with _locked(path):
        return save_cache(merge(load_cache(path), new), path)


def merge(old: Iterable[TuneEntry], new: Iterable[TuneEntry]) -> list[TuneEntry]:
    """New winners replace old ones with the same (gpu, shape, mode); others are kept."""
    merged = {e.key: e for e in old}
    merged.update({e.key: e for e in new})
    return list(merged.values())


def lookup(entries: Sequence[TuneEntry], gpu: str, shape: ConvShape, mode: str) -> TuneEntry | None:
    """The entry for exactly (gpu, shape, mode); else the same layer tuned at the nearest
    batch size (winners change little with B once the GPU is full); else None."""
    check_mode(mode)
    same_layer = [
        e
        for e in entries
        if e.gpu == gpu and e.mode == mode and e.shape.with_batch(shape.B) == shape
    ]
    if not same_layer:
        return None
    return min(same_layer, key=lambda e: (abs(math.log(e.shape.B / shape.B)), -e.shape.B))


def candidates(
    space: Mapping[str, Sequence[Any]],
    defaults: Mapping[str, Any],
    cap: int = DEFAULT_MAX_CANDIDATES,
) -> list[dict[str, Any]]:
    """The rung's defaults first, then the cartesian product of `space` thinned evenly to `cap`."""
    if cap < 1:
        raise ValueError(f"candidate cap must be >= 1, got {cap}")
    base = dict(defaults)
    keys = sorted(space)
    combos = [
        dict(base, **dict(zip(keys, vals, strict=True)))
        for vals in itertools.product(*(space[k] for k in keys))
    ]
    out: list[dict[str, Any]] = [base]
    rest = [c for c in combos if c != base]
    if len(rest) > cap - 1:
        step = len(rest) / max(1, cap - 1)
        rest = [rest[int(i * step)] for i in range(cap - 1)]
    out.extend(rest)
    return out[:cap]


def _key(params: Mapping[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def space_size(space: Mapping[str, Sequence[Any]]) -> int:
    return math.prod(len(v) for v in space.values()) if space else 1


def first_round(
    space: Mapping[str, Sequence[Any]], defaults: Mapping[str, Any], cap: int
) -> list[dict[str, Any]]:
    """What a search will try first: the whole space if it fits in `cap`, else the defaults
    and every one-parameter change of them (coordinate descent's first round)."""
    if space_size(space) <= cap:
        return candidates(space, defaults, cap)
    out = [dict(defaults)]
    for name in sorted(space):
        out += [dict(defaults, **{name: v}) for v in space[name] if v != defaults.get(name)]
    return out[:cap]


def coordinate_descent(
    space: Mapping[str, Sequence[Any]],
    defaults: Mapping[str, Any],
    measure: Callable[[dict[str, Any]], float],
    max_trials: int,
    rounds: int = 3,
) -> tuple[dict[str, Any], float]:
    """Search `space` one parameter at a time from the defaults, keeping every improvement,
    until a round improves nothing, `rounds` are done or `max_trials` were measured.
    Small spaces (<= max_trials points) are swept exhaustively instead. `measure` returns
    the time, or inf for a rejected candidate; each point is measured once."""
    if max_trials < 1:
        raise ValueError(f"max_trials must be >= 1, got {max_trials}")
    tried: dict[str, float] = {}

    def once(params: dict[str, Any]) -> float:
        key = _key(params)
        if key not in tried:
            tried[key] = measure(params)
        return tried[key]

    if space_size(space) <= max_trials:
        results = [(once(p), p) for p in candidates(space, defaults, max_trials)]
        value, best = min(results, key=lambda r: r[0])
        return best, value
    best = dict(defaults)
    best_value = once(best)
    for _ in range(rounds):
        improved = False
        for name in sorted(space):
            for value in space[name]:
                cand = dict(best, **{name: value})
                if _key(cand) in tried:
                    continue
                if len(tried) >= max_trials:
                    return best, best_value
                v = once(cand)
                if v < best_value:
                    best, best_value, improved = cand, v, True
        if not improved:
            break
    return best, best_value


# --------------------------------------------------------------------------------------
# The model's conv layers
# --------------------------------------------------------------------------------------

# A layer set the tuner takes besides the zoo models: DianNao's VGG16 layers (bench/cases.py),
# so `convolab tune --model vgg --batch B` caches winners for rungs 26-27's shapes.
VGG_LAYERS = "vgg"


def model_conv_shapes(model: str, batch: int) -> list[tuple[str, ConvShape]]:
    """(layer name, shape) of each conv layer of the zoo model, or of the VGG16 layer set
    (raises ValueError if unknown)."""
    if model == VGG_LAYERS:
        from convolab.bench.cases import vgg_cases

        return [(case.label.split("/")[-1], case.shape) for case in vgg_cases(batch)]
    return [(block.name, block.shape) for block in models.conv_blocks(model, batch)]


# --------------------------------------------------------------------------------------
# main: the sweep on the GPU
# --------------------------------------------------------------------------------------


def reference_conv(x: Any, w: Any, b: Any, stride: int) -> Any:
    """The fp64 reference every candidate is checked against (cpu-ref's computation)."""
    from convolab.conv_cpu import conv_reference

    return conv_reference(x, w, b, stride)


@dataclass
class Trial:
    layer: str
    impl: str
    mode: str
    params: dict[str, Any]
    ok: bool
    rel_l2: float = math.nan
    median_ms: float = math.nan
    spread_pct: float = math.nan
    note: str = ""


def tunable_impls() -> list[Any]:
    from convolab.registry import all_impls

    return [
        i
        for i in all_impls("gpu")
        if i.name not in NOT_TUNED and not i.pool and not i.reference_only
    ]


def _trial(
    impl: Any, layer: str, shape: ConvShape, params: dict[str, Any], data: dict[str, Any],
    reps: int, limit_ms: float = math.inf,
) -> Trial:
    import numpy as np

    from convolab.check import poison, rel_l2
    from convolab.timing import Stats, time_gpu

    cp = data["cp"]
    trial = Trial(layer, impl.name, mode_of(impl.tolerance), params, ok=False)
    try:
        full = impl.params_for(params)
        small = shape.with_batch(data["x_small"].shape[0])
        run_small = impl.prepare(small, data["w"], data["b"], full)
        y_small = cp.empty(impl.out_shape(small), dtype=np.float32)
        poison(y_small)
        run_small(data["x_small"], y_small)
        err_small = rel_l2(y_small, data["ref"])
        if not err_small <= impl.tolerance:
            trial.rel_l2, trial.note = err_small, "wrong on the check batch"
            return trial
        run = impl.prepare(shape, data["w"], data["b"], full)
        y = cp.empty(impl.out_shape(shape), dtype=np.float32)
        poison(y)
        first_ms = time_gpu(lambda: run(data["x"], y), reps=1, warmup=1)[0]
        if first_ms > limit_ms:
            trial.note = f"{first_ms:.3g} ms a run, over {limit_ms:.3g}: not timed further"
            return trial
        stats = Stats.of(time_gpu(lambda: run(data["x"], y), reps=reps, warmup=1))
        n = data["x_small"].shape[0]
        err_full = rel_l2(y[:n], data["ref"])
        trial.rel_l2 = max(err_small, err_full)
        if not err_full <= impl.tolerance:
            trial.note = "wrong at full batch"
            return trial
        trial.ok, trial.median_ms, trial.spread_pct = True, stats.median_ms, stats.spread_pct
    except Exception as err:  # a candidate that does not compile or launch is just rejected
        trial.note = f"{type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else ''}"
    return trial


def winners(
    trials: Iterable[Trial], gpu: str, shapes: Mapping[str, ConvShape], date: str
) -> list[TuneEntry]:
    """Per layer and mode, the fastest checked trial among rungs accurate enough for it."""
    out = []
    trials = [t for t in trials if t.ok]
    for layer, shape in shapes.items():
        for mode in TUNE_MODES:
            pool = [
                t
                for t in trials
                if t.layer == layer and TOLERANCE[t.mode] <= TOLERANCE[mode]
            ]
            if not pool:
                continue
            best = min(pool, key=lambda t: t.median_ms)
            out.append(
                TuneEntry(
                    gpu,
                    shape,
                    mode,
                    best.impl,
                    dict(best.params),
                    best.median_ms,
                    best.rel_l2,
                    date,
                )
            )
    return out


def precompile(
    plan: Sequence[tuple[str, ConvShape, Any, list[dict[str, Any]]]], progress: Any
) -> None:
    """Compile every candidate's kernels in parallel threads first (NVRTC dominates the
    sweep otherwise): each is prepared once on a 1-image shape and thrown away; anything
    that fails here fails again, and is recorded, in its trial."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from convolab.backend import require_cupy

    cp = require_cupy()
    jobs = [
        (impl, shape.with_batch(1), params) for _, shape, impl, cands in plan for params in cands
    ]
    task = progress.add_task("compiling", total=len(jobs))

    def compile_one(job: tuple[Any, ConvShape, dict[str, Any]]) -> None:
        impl, shape, params = job
        try:
            w = cp.zeros(shape.w_shape, np.float32)
            impl.prepare(shape, w, cp.zeros(shape.M, np.float32), impl.params_for(params))
        except Exception:  # noqa: S110 - reported by the trial itself
            pass
        progress.advance(task)

    with ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 2))) as pool:
        list(pool.map(compile_one, jobs))


def _layer_data(cp: Any, rng: Any, shape: ConvShape) -> dict[str, Any]:
    """One layer's random problem on the device, with the fp64 answer for its first images."""
    import numpy as np

    x = rng.random(shape.x_shape, dtype=np.float32)
    w = (rng.standard_normal(shape.w_shape) / math.sqrt(shape.C * shape.K**2)).astype(np.float32)
    b = rng.standard_normal(shape.M).astype(np.float32)
    n = min(CHECK_BATCH, shape.B)
    return {
        "cp": cp,
        "x": cp.asarray(x),
        "x_small": cp.asarray(x[:n]),
        "w": cp.asarray(w),
        "b": cp.asarray(b),
        "ref": reference_conv(x[:n], w, b, shape.S),
    }


def pool_best(done: Mapping[str, Trial], tolerance: float) -> float:
    """The fastest checked time among trials of rungs accurate enough for a rung of
    `tolerance` to compete with (they win its mode if faster)."""
    times = [t.median_ms for t in done.values()
             if t.ok and TOLERANCE[t.mode] <= TOLERANCE[mode_of(tolerance)]]
    return min(times, default=math.inf)


def start_params(impl: Any, shape: ConvShape) -> dict[str, Any]:
    """Where a rung's screen and search start: the parameters `auto`'s shape model gives it
    for this shape where the model would run it (the implicit GEMMs' tiles depend on M and
    on the wave count: their fixed defaults are one shape's tiles), else its defaults."""
    from convolab.gpu import auto

    choice = auto.default_choice(shape, {impl.name}, mode_of(impl.tolerance))
    return impl.params_for(choice.params if choice.impl == impl.name else None)


def _screen(pairs: Sequence[tuple[str, ConvShape, Any, list[dict[str, Any]]]],
            data: dict[str, Any], reps: int, progress: Any, task: Any) -> dict[str, Trial]:
    """Every rung of one layer at its `start_params`; a run slower than SEARCH_WITHIN x the
    fastest start it competes with so far is not timed further."""
    screened: dict[str, Trial] = {}
    for layer, shape, impl, _first in pairs:
        progress.update(task, description=f"{layer} {impl.name:<20} start")
        limit = SEARCH_WITHIN * pool_best(screened, impl.tolerance)
        screened[impl.name] = _trial(impl, layer, shape, start_params(impl, shape), data, reps,
                                     limit_ms=limit)
        progress.advance(task)
    return screened


def _search(impl: Any, layer: str, shape: ConvShape, default: Trial, data: dict[str, Any],
            cap: int, reps: int, progress: Any, task: Any) -> list[Trial]:
    """Coordinate descent from the rung's (already measured) start."""
    trials: list[Trial] = []

    def measure(params: dict[str, Any]) -> float:
        if _key(params) == _key(default.params):
            return default.median_ms
        trial = _trial(impl, layer, shape, params, data, reps,
                       limit_ms=SEARCH_WITHIN * default.median_ms)
        trials.append(trial)
        progress.advance(task)
        return trial.median_ms if trial.ok else math.inf

    progress.update(task, description=f"{layer} {impl.name:<20}")
    coordinate_descent(impl.space, default.params, measure, cap)
    return trials


def search_order(screened: Mapping[str, Mapping[str, Trial]]) -> list[tuple[str, str]]:
    """(layer, rung) pairs worth a search, most promising first: checked, and at defaults
    within SEARCH_WITHIN of the fastest defaults each competes with, ordered by that ratio
    (so a budget spends itself on every layer's leaders before anyone's runners-up)."""
    ranked = []
    for layer, trials in screened.items():
        for name, t in trials.items():
            best = pool_best(trials, TOLERANCE[t.mode])
            if t.ok and t.median_ms <= SEARCH_WITHIN * best:
                ranked.append((t.median_ms / best, layer, name))
    return [(layer, name) for _, layer, name in sorted(ranked)]


def sweep(
    plan: Sequence[tuple[str, ConvShape, Any, list[dict[str, Any]]]],
    cap: int,
    reps: int,
    budget_s: float,
    progress: Any,
) -> list[Trial]:
    """Every layer's rungs at their start first (`_screen`, newest rung first: the newest
    are usually the fastest, and a fast time known early lets slow rungs stop after one run),
    then coordinate descents (at most `cap` candidates each) in `search_order`, until
    `budget_s` seconds have passed since the start."""
    import numpy as np

    from convolab.backend import require_cupy

    cp = require_cupy()
    rng = np.random.default_rng()
    started = time.perf_counter()
    task = progress.add_task("tuning", total=len(plan) * cap)
    data: dict[str, dict[str, Any]] = {}
    screened: dict[str, dict[str, Trial]] = {}
    for layer in dict.fromkeys(entry[0] for entry in plan):
        pairs = [entry for entry in plan if entry[0] == layer]
        data[layer] = {"layer": layer, **_layer_data(cp, rng, pairs[0][1])}
        screened[layer] = _screen(pairs[::-1], data[layer], reps, progress, task)
    trials = [t for layer_trials in screened.values() for t in layer_trials.values()]
    pairs_by_key = {(layer, impl.name): (shape, impl) for layer, shape, impl, _ in plan}
    for layer, name in search_order(screened):
        if time.perf_counter() - started > budget_s:
            break
        shape, impl = pairs_by_key[(layer, name)]
        trials += _search(impl, layer, shape, screened[layer][name], data[layer], cap, reps,
                          progress, task)
    return trials


def print_winners(console: Any, found: Sequence[TuneEntry],
                  layers: Sequence[tuple[str, ConvShape]], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in ("layer", "mode", "winner", "params", "median ms", "GFLOP/s", "rel L2"):
        table.add_column(col)
    shapes = dict(layers)
    for e in found:
        layer = next(name for name, s in shapes.items() if s == e.shape)
        gflops = shapes[layer].flops / (e.median_ms * 1e6)
        table.add_row(layer, e.mode, e.impl, json.dumps(e.params, sort_keys=True),
                      f"{e.median_ms:.3f}", f"{gflops:.0f}", f"{e.rel_l2:.1e}")
    console.print(table)


def main(
    model: str = "ece408", batch: int = 10_000, reps: int = 10, json_out: Path | None = None
) -> list[TuneEntry]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if reps < 1:
        raise ValueError(f"reps must be positive, got {reps}")
    cap = int(os.environ.get("CONVOLAB_TUNE_MAX_CANDIDATES", DEFAULT_MAX_CANDIDATES))
    budget_s = float(os.environ.get("CONVOLAB_TUNE_BUDGET_S", "inf"))
    console = Console()
    gpu = gpu_name()
    layers = model_conv_shapes(model, batch)
    plan = [
        (layer, shape, impl, first_round(impl.space, impl.defaults, cap))
        for layer, shape in layers
        for impl in tunable_impls()
        if impl.supports(shape)
    ]
    console.print(
        f"tuning {model} at B={batch} on {gpu}: {len(plan)} (layer, rung) pairs, "
        f"each at its start (auto's tiles, else its defaults), then at most {cap} candidates "
        f"for those within "
        f"{SEARCH_WITHIN:g}x of the fastest (whole space if it fits, else coordinate descent), "
        f"{reps} reps each"
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        precompile([(layer, shape, impl, [start_params(impl, shape)])
                    for layer, shape, impl, _ in plan], progress)
        trials = sweep(plan, cap, reps, budget_s, progress)
    date = _dt.date.today().isoformat()
    found = winners(trials, gpu, dict(layers), date)
    path = update_cache(found)
    print_winners(console, found, layers, f"convolab tune: {model}, B={batch}, {gpu}")
    rejected = [t for t in trials if not t.ok]
    console.print(
        f"{len(trials) - len(rejected)} candidates passed the check, {len(rejected)} "
        f"rejected; cache written to {path}"
    )
    json_out = json_out or os.environ.get("CONVOLAB_TUNE_JSON") or None
    if json_out is not None:
        record = {"gpu": gpu, "model": model, "batch": batch, "reps": reps, "date": date,
                  "winners": [e.to_json() for e in found], "trials": [t.__dict__ for t in trials]}
        Path(json_out).write_text(json.dumps(record, indent=1, default=str))
    return found
