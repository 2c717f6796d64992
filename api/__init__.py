"""kiln's HTTP API: native jobs, OpenAI-compatible videos, workers, health and metrics."""
