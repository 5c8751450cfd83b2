"""Figures sent to the Trainer's loggers, only under ``pipeopt/``. Every key pipeopt emits is in this table.

=================================  =============================================================  =================
key                                meaning                                                        when
=================================  =============================================================  =================
``pipeopt/samples_per_s``          samples per second over the window                             each window
``pipeopt/steps_per_s``            optimizer steps per second over the window                     each window
``pipeopt/step_time_ms``           mean wall time of an optimizer step                            each window
``pipeopt/data_wait_frac``         share of step time the loop was blocked waiting for a batch    each window
``pipeopt/transfer_frac``          share of step time spent moving batches to the device          each window
``pipeopt/busy_frac``              share of step time in forward + backward + optimizer           each window
``pipeopt/cpu_main_pct``           CPU use of the training process (100 = one core)               each window
``pipeopt/cpu_workers_pct``        CPU use of its loader workers (100 = one core)                 each window
``pipeopt/peak_mem_mb``            CUDA allocator peak up to the window's end (measurement.md)    CUDA only
``pipeopt/gpu_util_pct``           NVML GPU utilisation, mean over the window                     NVML only
``pipeopt/gpu_mem_used_mb``        NVML memory used on the device, max over the window            NVML only
``pipeopt/gpu_power_w``            NVML power draw, mean over the window                          NVML only
``pipeopt/gpu_temp_c``             NVML GPU temperature, mean over the window                     NVML only
``pipeopt/gpu_sm_clock_mhz``       NVML SM clock, mean over the window                            NVML only
``pipeopt/reserved_mem_mb``        CUDA allocator reserve, its peak counted as peak_mem_mb's      CUDA only
``pipeopt/input_free_speedup``     estimated speedup if input were free (from the before-window)  end of fit
``pipeopt/predicted_speedup``      the kept change's predicted speedup (from its trial)           a change kept
``pipeopt/measured_speedup``       after-window over before-window throughput                     end of fit
``pipeopt/prediction_error``       |predicted - measured speedup| / measured, of the kept change  a change kept
``pipeopt/memory/params_mb``       parameters (one rank)                                          end of fit
``pipeopt/memory/grads_mb``        gradients                                                      end of fit
``pipeopt/memory/optimizer_mb``    optimizer state                                                end of fit
``pipeopt/memory/activations_mb``  activations one micro-batch saves for backward                 end of fit
``pipeopt/memory/batch_mb``        the micro-batch on the device                                  end of fit
``pipeopt/memory/per_sample_mb``   activations and input per sample                              end of fit
``pipeopt/time/epoch_s_before``    an epoch's time at the before-window's pace                    end of fit
``pipeopt/time/epoch_s_after``     an epoch's time at the after-window's pace                     end of fit
``pipeopt/cost/epoch_before``      an epoch's cost at the before-window's pace                    ``cost_per_hour``
``pipeopt/cost/epoch_after``       an epoch's cost at the after-window's pace                     ``cost_per_hour``
``pipeopt/cost/fit_saving``        the whole fit's cost before less after                         ``cost_per_hour``
=================================  =============================================================  =================
"""

from __future__ import annotations

from pipeopt.measure.window import WindowStats
from pipeopt.report.model import Report

_MB = 1024 * 1024


def window_metrics(stats: WindowStats) -> dict[str, float]:
    res = stats.resources
    candidates: dict[str, float | None] = {
        "pipeopt/samples_per_s": stats.samples_per_s,
        "pipeopt/steps_per_s": stats.steps_per_s,
        "pipeopt/step_time_ms": stats.step_time_s * 1e3,
        "pipeopt/data_wait_frac": stats.data_wait_frac,
        "pipeopt/transfer_frac": stats.transfer_frac,
        "pipeopt/busy_frac": stats.busy_frac,
        "pipeopt/cpu_main_pct": res.cpu_main_pct,
        "pipeopt/cpu_workers_pct": res.cpu_workers_pct,
        "pipeopt/peak_mem_mb": None if res.peak_mem_bytes is None else res.peak_mem_bytes / _MB,
        "pipeopt/gpu_util_pct": res.gpu_util_pct,
        "pipeopt/gpu_mem_used_mb": None if res.gpu_mem_used_bytes is None else res.gpu_mem_used_bytes / _MB,
        "pipeopt/gpu_power_w": res.gpu_power_w,
        "pipeopt/gpu_temp_c": res.gpu_temp_c,
        "pipeopt/gpu_sm_clock_mhz": res.gpu_sm_clock_mhz,
        "pipeopt/reserved_mem_mb": None if res.peak_reserved_bytes is None else res.peak_reserved_bytes / _MB,
    }
    return {k: float(v) for k, v in candidates.items() if v is not None}


def summary_metrics(report: Report) -> dict[str, float]:
    """The fit's figures for the logger. Where the before window ran an earlier run's settings (``before_ran``), the
    figures that compare with the user's settings are left out: no window measured those."""
    yours = report.before_ran is None
    candidates = {
        "pipeopt/input_free_speedup": report.verdict.input_free_speedup if report.verdict else None,
        "pipeopt/predicted_speedup": report.predicted_speedup,
        "pipeopt/measured_speedup": report.measured_speedup if yours else None,
        "pipeopt/prediction_error": report.prediction_error,
        **(_fit_metrics(report, yours) if report.before is not None else {}),  # a fit with no window logs nothing
    }
    return {k: float(v) for k, v in candidates.items() if v is not None}


def _fit_metrics(report: Report, yours: bool) -> dict[str, float | None]:
    fit = report.fit
    if fit is None:
        return {}
    memory, time = fit.memory, fit.time
    per_sample = memory.per_sample_bytes if memory else None
    sizes = {} if memory is None else {
        "params": memory.params_bytes, "grads": memory.grads_bytes, "optimizer": memory.optimizer_bytes,
        "activations": memory.activations_bytes, "batch": memory.batch_bytes, "per_sample": per_sample}
    return {**{f"pipeopt/memory/{k}_mb": None if v is None else v / _MB for k, v in sizes.items()},
            "pipeopt/time/epoch_s_before": time.epoch_s_before if yours else None,
            "pipeopt/time/epoch_s_after": time.epoch_s_after,
            "pipeopt/cost/epoch_before": time.epoch_cost_before if yours else None,
            "pipeopt/cost/epoch_after": time.epoch_cost_after,
            "pipeopt/cost/fit_saving": time.fit_saving if yours else None}
