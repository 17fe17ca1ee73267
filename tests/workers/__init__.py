"""Code that runs inside spawned ranks (started by :func:`dtypeplan.launch.spawn`)."""
