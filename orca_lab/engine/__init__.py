"""Algorithm 1's loop and what it schedules: requests, schedulers and policies, the K/V slot and
block managers, batches, the executor interface and the loop itself. No model inside."""
