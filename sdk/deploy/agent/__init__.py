"""Device side of `colibri-sdk deploy`: the store logic that runs ON the device (standard library only).

The deploying machine sends these modules' sources in one `python3 -c BOOTSTRAP OP ROOT ARG...` command
(`colibri_sdk.deploy.remote.agent_source`), which makes them importable as the package `colibri_agent` (a
module is compiled when first imported, so an operation's start pays only for the modules it uses) and calls
`main.main`. Every argument is quoted by `shlex.quote`; paths travel as argv entries and are never seen by a
shell. Python 3.8 compatible (JetPack 5 ships 3.8, JetPack 6 ships 3.10): nothing needs installing on the device.

    common.py     AgentError, the JSON answer, argument checks, hashing, fsync, the ROOT/.lock flock
    layout.py     what under ROOT is the store's: an entry it did not make is refused before anything changes
    receiver.py   `receive`: store objects streamed on stdin, hashed on the device as they are written
    objects.py    the content-addressed store: `plan`, garbage collection
    bundles.py    bundle folders: `stage` (hard links into the store, every file hashed), listing, pruning
    pointers.py   current / previous / history: `switch`, `rollback` (steps back through history), `undo`
    status.py     `status`: bundles, pointers, store usage, each bundle's model summary
    runtime.py    `probe` (machine, Python, ABI, glibc) and `install` (a venv from shipped wheels, offline)
    main.py       the operation table and the error answer

Layout under ROOT (the --remote-dir):

    ROOT/store/<sha256>            one read-only file per distinct content, stored only after its sha256 was
                                   computed on the device and matched; `.partial` while an upload is in progress
    ROOT/bundles/<id>/...          a bundle folder: hard links into the store; <id> = first 16 hex digits of
                                   the sha256 of the bundle's manifest.json
    ROOT/current -> bundles/<id>   the active bundle; replaced by rename(2) of a new symlink (atomic)
    ROOT/previous -> bundles/<id>  the bundle activated before it (the one `rollback` goes back to)
    ROOT/history                   JSON list of activated bundle ids, oldest first; `rollback` pops the newest
    ROOT/wheels/<file>.whl         wheels shipped by `--install-runtime` (hard links into the store)
    ROOT/venv/                     the device runtime's virtual environment; ROOT/runtime.json records it
    ROOT/.lock                     flock(2) held while a bundle folder is staged or a pointer is switched

A ROOT where bundles/, store/, current, previous, history or .lock holds something else (a user's folder in
bundles/, their own `history` file) is refused before anything is created or changed there (layout.py): the store
deletes and overwrites only what it made.

Errors from the operating system print {"error": {"errno": NAME, "path": PATH, "message": TEXT}} and exit 3.
"""
