"""What MPI library a job runs on, for benchmark reports.

Only asks mpi4py when the communicator already runs on MPI, so a one-process
run without a launcher never starts MPI just to describe it.

Example::

    mpi_info(comm)["library_version"]     # 'MPICH Version: 4.3.0 ...'
"""

from __future__ import annotations


def mpi_info(comm) -> dict:
    """MPI library version string, MPI standard version and mpi4py version.

    Example::

        info = mpi_info(create_communicator())
        print(info["library_version"] or info["note"])
    """
    if getattr(comm, "name", None) != "mpi":
        return {"library_version": None, "standard": None, "mpi4py": None,
                "note": "one process without an MPI launcher: MPI not started"}
    import mpi4py
    from mpi4py import MPI
    major, minor = MPI.Get_version()
    return {"library_version": library_version_text(MPI.Get_library_version()),
            "standard": f"{major}.{minor}", "mpi4py": mpi4py.__version__,
            "note": ""}


def library_version_text(raw: str) -> str:
    """MPI's library version string as text: Open MPI's ends in a NUL character
    (its C string's end), which would follow it into JSON and reports.

    Example::

        library_version_text("Open MPI v5.0.11, ...\\x00")     # 'Open MPI v5.0.11, ...'
    """
    return raw.replace("\0", "").strip()
