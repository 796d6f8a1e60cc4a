"""The simulator (docs/design.md, layer 6): the engine's loop, schedulers and K/V slot manager, unchanged,
driving a cost model on a virtual clock instead of a GPT.

- ``executor``: ``SimExecutor``, pipeline stages as resources, ``VirtualClock`` time;
- ``cost``: the analytical model of the paper's GPUs (A100-40GB/80GB, H100, H200), sources beside numbers;
- ``calibration``: its parameters fitted to published GPU measurements (the default cost model);
- ``fitted``: a model fitted to the real engine's iteration timings on the machine at hand;
- ``run``: backends (simulated or real), one point, rate sweeps, the paper's headline, Figure 9;
- ``memory``: how much reserved K/V memory holds real tokens under four reservation schemes;
- ``fidelity``: the real engine vs the simulator on the fitted model, same traces;
- ``params``: checks of the reproduction notebooks' parameters.
"""
