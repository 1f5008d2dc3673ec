"""Kubernetes operator (kopf) reconciling InferenceService resources."""
