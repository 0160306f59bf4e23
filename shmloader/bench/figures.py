"""The figures of a measurement (session.py): medians over repetitions, ratios to torch.
Every figure that benchmarks/ and `python -m shmloader.compare` report is defined here.
"""

import dataclasses
import statistics
from typing import TYPE_CHECKING, Any, cast

from .limit import LIMIT
from .measure import Epoch

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from .session import Measurement

REFERENCE = "torch"
# Figures compared as (loader / torch): above 1 is better for throughput, worse for the rest.
RATIO_FIGURES = ("samples_per_s", "gb_per_s", "cpu_s_per_batch", "first_batch_s")
# Memory figures compared as (loader / torch), where both were measured.
MEMORY_RATIO_FIGURES = ("peak_pss_bytes", "added_pss_bytes")


def throughput_figures(epochs: list[Epoch]) -> dict[str, Any]:
    """Medians over repetitions, with every repetition kept."""
    rates = [e.samples / e.wall_s for e in epochs]
    return {
        "samples_per_s": statistics.median(rates),
        "gb_per_s": statistics.median(e.bytes / e.wall_s / 1e9 for e in epochs),
        # (max - min) / median of samples/s: how far apart the repetitions were.
        "throughput_spread": (max(rates) - min(rates)) / statistics.median(rates),
        "epochs": [{**dataclasses.asdict(e), "loader_cpu_s": e.loader_cpu_s} for e in epochs],
    }


def figures(
    epochs: list[Epoch],
    first_batch_reps_s: list[float],
    memory: dict[str, Any] | None,
    stats: Any,
    limit: dict[str, Any] | None,
) -> dict[str, Any]:
    """One loader's figures, with its throughput as a fraction of the limit's where the
    limit was measured."""
    result = throughput_figures(epochs)
    if limit is not None:
        result["fraction_of_limit"] = result["samples_per_s"] / limit["samples_per_s"]
    result.update(
        {
            # What the training loop loses to the loader: the main process's CPU less the
            # consumer's own (the same reads for every loader, though they cost more on
            # torch's fresh segments), with both kept beside it.
            "cpu_s_per_batch": statistics.median(e.loader_cpu_s / e.batches for e in epochs),
            "main_cpu_s_per_batch": statistics.median(e.cpu_s / e.batches for e in epochs),
            "consumer_cpu_s_per_batch": statistics.median(
                e.consumer_cpu_s / e.batches for e in epochs
            ),
            # Of the epoch's time, how long the loop was blocked waiting for the next batch:
            # near 1 the loop is data-bound, near 0 the loader keeps up.
            "wait_fraction": statistics.median(e.wait_s / e.wall_s for e in epochs),
            "first_batch_s": statistics.median(first_batch_reps_s),
            "memory": memory,
            "first_batch_reps_s": first_batch_reps_s,
        }
    )
    if stats is not None:
        result["stats"] = (
            # (is_dataclass is true of a dataclass's class too; stats() returns an instance)
            dataclasses.asdict(cast("DataclassInstance", stats))
            if dataclasses.is_dataclass(stats)
            else repr(stats)
        )
    return result


def measurement_figures(
    measurement: "Measurement",
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """(figures by loader name, the limit's throughput figures or None)."""
    epochs = measurement.epochs
    # The limit's main process only waits: it has throughput figures and nothing else.
    limit = throughput_figures(epochs[LIMIT]) if LIMIT in epochs else None
    loaders = {
        name: figures(
            epochs[name],
            measurement.first_batch_s[name],
            measurement.memory[name],
            measurement.stats[name],
            limit,
        )
        for name in measurement.first_batch_s
    }
    return loaders, limit


def ratios(loaders: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each other loader's figures divided by torch's."""
    if REFERENCE not in loaders:
        return {}
    ref = loaders[REFERENCE]
    result = {}
    for name, figs in loaders.items():
        if name == REFERENCE:
            continue
        ratio = {key: _ratio(figs[key], ref[key]) for key in RATIO_FIGURES}
        if figs["memory"] and ref["memory"]:
            ratio.update(
                {
                    key: _ratio(figs["memory"][key], ref["memory"][key])
                    for key in MEMORY_RATIO_FIGURES
                }
            )
        result[f"{name}/{REFERENCE}"] = ratio
    return result


def figure_at(figs: dict[str, Any] | None, keys: tuple[str, ...]) -> Any:
    """The figure at `keys`, outermost first, in a record's nested figures; None where
    one of them is missing."""
    value: Any = figs
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _ratio(value: float, reference: float) -> float | None:
    """None where torch's figure is 0 (memory the tree gave back, say): no ratio."""
    return value / reference if reference else None
