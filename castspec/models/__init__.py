"""Native model modules: the target decoder and the DFlash block drafter."""
