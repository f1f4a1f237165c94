"""The TorchX components of elasticrl (``elasticrl.py``, registered as the ``elasticrl`` entry
point), and the launch defaults, once, for the components, ``elasticrl launch`` and the nodes
(``launch``, which builds its apps from these components)."""

OUTPUT = "runs/launch"  # the job's output folder when the launch names none
JOIN_TIMEOUT_S = 600    # seconds the head waits for every node to join, and a node for the head's address
LOST_S = 60             # seconds a pool node waits for a head that stopped answering before it fails
