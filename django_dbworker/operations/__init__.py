"""What operators see of a running coordinator: metrics, the probe server, tracing and the events they count."""
