"""User-facing errors: each message says what to change. The CLI prints them without a traceback."""


class FlexmeshError(Exception):
    """An error caused by the user's input (spec, plan, file); its message says what to change."""


class SpecError(FlexmeshError):
    """A model or cluster spec is unknown, incomplete or inconsistent."""


class PlanError(FlexmeshError):
    """A plan is invalid, does not fit in memory, or no plan exists for the request."""


class ScheduleError(FlexmeshError):
    """A batch cannot be scheduled (for instance a sequence that fits nowhere)."""


class CheckpointError(FlexmeshError):
    """A checkpoint is missing, corrupt or from another plan."""


class DataError(FlexmeshError):
    """A corpus, tokenizer or token cache is missing, empty or malformed."""


class ProfileError(FlexmeshError):
    """A hardware or model profile is missing, malformed, of another version or kind, or from another model."""


class RunFolderError(FlexmeshError):
    """An output folder is in use by another run, or holds a run that starting over would overwrite."""


class OutputError(FlexmeshError):
    """A path flexmesh would write is something other than what it writes there (a symlink, a device, a
    fifo, a socket, a folder for a file or a file for a folder): it is refused, never replaced."""


class RankError(FlexmeshError):
    """A rank stopped answering: a collective waited longer than the collective timeout."""


class ServeError(FlexmeshError):
    """An engine or router cannot start or answer (a port in use, an engine that failed), or a serving
    request or trace is malformed."""
