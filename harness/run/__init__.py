"""A tuning run: its plan carried out on the fleet (``runner``), the order of its
studies' work (``schedule``), the finalists' re-measurement (``remeasure``) and
the fault injection its tests use (``faults``)."""
