"""The Ray backend (``cluster.backend: ray``): the cluster's inventory (``cluster``), placement
groups (``placement``), start-up (``up``), the supervisor's backend (``backend``) and the actor
that runs one worker process on a node (``actor``)."""
