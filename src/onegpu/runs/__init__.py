"""What every backend's run shares, with no framework import: the run folder and its sinks
(metrics.jsonl, TensorBoard), the meter of the log rows, and graceful stops on signals."""
