"""Make fairseq's log records carry every digit, for tests that compare logged losses exactly.

fairseq rounds each meter to its ``round`` when logging (``loss`` to 3 decimals: a hidden tolerance
of about 5e-4) and prints floats with ``{:g}`` (6 significant digits). The launch scripts of tests
that compare losses call ``log_every_digit()`` before training; training itself is untouched
(rounding only ever applied to what is displayed and to best-checkpoint comparisons).
"""


def log_every_digit() -> None:
    from fairseq.logging import meters, progress_bar

    def unrounded(meter):
        value = meter.avg
        return value.item() if hasattr(value, "item") else value

    meters.AverageMeter.smoothed_value = property(unrounded)
    shown = progress_bar.format_stat

    def format_stat(stat):  # repr round-trips a float exactly
        return repr(stat) if isinstance(stat, float) else shown(stat)

    progress_bar.format_stat = format_stat


def carries_every_digit(losses) -> bool:
    """False for losses that look rounded to fairseq's 3 decimals (the chance that a dozen real
    losses all have 3 decimals or fewer is nil)."""
    return any(round(loss, 3) != loss for loss in losses)
