"""The course's machinery: graders for the learner's exercises (``grade``), the plug points their
functions go into (``plug``, ``online_softmax``), and the merge of the solutions kept apart from the
learner notebooks (``solve``)."""
