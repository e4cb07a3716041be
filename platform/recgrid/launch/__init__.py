"""Everything that talks to a cluster or a person: the Ray driver, Job API submission, the local
gloo launcher, MLflow tracking, progress and summary reports, and group-count comparisons."""
