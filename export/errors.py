"""The export package's error type (raised by export/pipeline.py and the family modules in export/families/)."""


class ExportError(RuntimeError):
    """Export cannot proceed; the message says what to do."""
