"""Engine replicas behind one endpoint on Ray Serve: routing, the replica and front deployments, metrics."""
