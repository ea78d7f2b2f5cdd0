"""What fairseq-train decides around the model: the save dir (its lock and checks), which
checkpoint a run restores, the set id of its saves, the resume policy, and sparse upcycling with
the checkpoint tool's ``upcycle`` subcommand.

Modules:
    save_dir_lock.py      one training job per save dir (a lock file naming its holder)
    shared_save_dir.py    every worker of a multi-node run sees the same save dir
    training_save_dir.py  the save-dir checks a run makes at start-up, released at exit
    restore_choice.py     which checkpoint --restore-file names, and what an absent one means
    set_identity.py       the launch values every worker derives a save's set id from
    resume_policy.py      which options may change on resume, and how each change is reported
    upcycling.py          sparse upcycling's fairseq side: the MoE config, --moe-upcycle-from
    upcycle_cli.py        the checkpoint tool's ``upcycle`` flags (fairseq is imported only when it runs)

Nothing is imported here, so ``fairseq-moe upcycle`` (console.py) can load ``upcycle_cli`` on a
machine without fairseq.
"""
