"""Errors that are the user's to fix: the CLI prints them as one line, without a traceback."""


class MirrorError(Exception):
    """Base class for errors caused by input (paths, files, parameters, prompts)."""


class ModelLoadError(MirrorError):
    """A model path, hub id or file that cannot be loaded."""


class InvalidParameter(MirrorError, ValueError):
    """A sampling or decoding parameter out of range."""


class PromptTooLong(MirrorError):
    """A prompt that does not fit in the model's context."""


class IncompatibleDraft(MirrorError):
    """A draft that cannot serve a target (vocabulary or tokenizer mismatch)."""


class EngineBusy(MirrorError):
    """Another generation held the engine longer than the caller's `wait`."""


class EngineClosed(MirrorError):
    """The engine was closed; it cannot generate any more."""


class PromptFileError(MirrorError):
    """A prompt file that is missing or not in Spec-Bench format."""


class DataFileError(MirrorError):
    """A distillation data file (replies to label) that is missing or not of the form read."""


class MissingExtra(MirrorError):
    """An optional dependency that a command needs is not installed."""


class DistributedError(MirrorError):
    """A run across several processes that cannot go on: a rank died, cannot be reached,
    did not answer in time, or loaded different weights."""
