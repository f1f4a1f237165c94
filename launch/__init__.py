"""What each node of a launched job runs (``node.py``) and the glue that submits, follows and
restarts it (``submit.py``), building its apps from the TorchX components (``components``, which
hold the launch defaults and import nothing of this package)."""
