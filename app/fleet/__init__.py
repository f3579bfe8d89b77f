"""What spans replicas: routing turns to decode replicas, drains, the decode memory
budgets, per-role autoscaling, and the ingress's clients of the engine deployments."""
