"""The environment variables the launcher sets for its children: their names' one home.

Settings travel in the child's settings file; the environment carries only what must be known
before that file is read, or what a library reads from the environment itself.
"""

KEYS_ENV = "LLAMADEPLOY_CURVE_KEYS"  # the folder of this deployment's CURVE keys (router and worker children)
PARENT_ENV = "LLAMADEPLOY_PARENT_PID"  # the supervisor's pid: the child dies with it (worker.contract.lifeline)
EXPECTED_GPUS_ENV = "LLAMADEPLOY_EXPECTED_GPUS"  # JSON: the GPUs placement expects this worker to see, and its share
SLOT_DEVICE_ENV = "LLAMADEPLOY_SLOT_DEVICE"  # a tensor-parallel rank: the whole slot's label, for its Hello
NODE_ID_ENV = "LLAMADEPLOY_NODE_ID"  # Ray's hex node id of the worker's node (empty locally)
NODE_IP_ENV = "LLAMADEPLOY_NODE_IP"  # that node's address
RAY_GPU_IDS_ENV = "LLAMADEPLOY_RAY_GPU_IDS"  # ray.get_gpu_ids(), comma-separated
