"""What each node of a launched job runs (``node.py``) and the glue that submits, follows and
restarts it (``submit.py``). The launch defaults live here, once, for ``elasticrl launch``,
the TorchX component (``components/elasticrl.py``) and the nodes."""

OUTPUT = "runs/launch"  # the job's output folder when the launch names none
JOIN_TIMEOUT_S = 600    # seconds the head waits for every node to join, and a node for the head's address
LOST_S = 60             # seconds a pool node waits for a head that stopped answering before it fails
