"""The one exception type users see: a problem they can fix, said in one line."""


class UserError(Exception):
    """Bad input (config, data, checkpoint, cluster address) with a one-line fix.

    The CLI prints ``distbelief: error: <message>`` and exits with code 2; the Python API
    raises it before any actor is started.
    """


def one_of(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise a one-line :class:`UserError` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise UserError(f"{flag} {value!r} is unknown: choose one of {', '.join(allowed)}")
