"""A tuning run: its plan carried out on the fleet (``runner``), each experiment's part of
it (``members``) and several experiments on one fleet (``campaign``), the order of the
studies' work (``schedule``), the finalists' re-measurement (``remeasure``), the winners
frozen into packs (``freeze``), what the run reports (``results``) and the fault
injection its tests use (``faults``)."""
