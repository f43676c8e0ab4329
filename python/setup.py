"""Builds the tensord package: pip install --no-build-isolation ./python

The extension compiles against include/tensord.h and <dlpack/dlpack.h> and
links libtensord, found in this order:
  1. $TENSORD_BUILD_DIR: that build tree's client/libtensord.a (static, so
     the installed module needs no libtensord.so at run time);
  2. `pkg-config tensord` (an installed libtensord: its headers, and its
     shared library, with an rpath to its libdir);
  3. the build tree next to this directory: ../build/client/libtensord.a.
The version is include/tensord.h's (TD_VERSION_*).
"""

import os
import re
import shlex
import subprocess

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.environ.get("TENSORD_SOURCE_DIR") or os.path.dirname(HERE)


def header() -> str:
    path = os.path.join(TOP, "include", "tensord.h")
    if not os.path.exists(path):
        raise SystemExit(
            f"tensord setup.py: {path} not found; build from the tensord "
            "source tree (pip install --no-build-isolation ./python) or set "
            "TENSORD_SOURCE_DIR"
        )
    return path


def version() -> str:
    text = open(header()).read()
    parts = [
        re.search(rf"#define TD_VERSION_{p} +(\d+)", text).group(1)
        for p in ("MAJOR", "MINOR", "PATCH")
    ]
    return ".".join(parts)


def pkg_config(*args: str) -> list:
    out = subprocess.run(
        ["pkg-config", *args, "tensord"], capture_output=True, text=True
    )
    if out.returncode != 0:
        return None
    return shlex.split(out.stdout)


def static_build(build: str) -> dict:
    lib = os.path.join(build, "client", "libtensord.a")
    if not os.path.exists(lib):
        raise SystemExit(
            f"tensord setup.py: {lib} not found: build libtensord first "
            "(cmake -S . -B build && cmake --build build), or set "
            "TENSORD_BUILD_DIR, or install it so that pkg-config finds "
            "tensord"
        )
    return dict(
        include_dirs=[os.path.join(TOP, "include")],
        extra_objects=[lib],
        libraries=["protobuf-c", "jansson", "pthread"],
        extra_link_args=["-Wl,--exclude-libs,ALL"],
    )


def link_args() -> dict:
    build = os.environ.get("TENSORD_BUILD_DIR")
    if build:
        return static_build(build)
    cflags = pkg_config("--cflags")
    libs = pkg_config("--libs")
    if cflags is not None and libs is not None:
        libdir = pkg_config("--variable=libdir") or []
        return dict(
            extra_compile_args=cflags,
            extra_link_args=libs + [f"-Wl,-rpath,{d}" for d in libdir],
        )
    return static_build(os.path.join(TOP, "build"))


args = link_args()
args["extra_compile_args"] = args.get("extra_compile_args", []) + [
    "-std=gnu11",
    "-fvisibility=hidden",
]
ext = Extension(
    "tensord._tensord",
    sources=["tensord/_tensord.c"],
    define_macros=[("_GNU_SOURCE", None)],
    **args,
)

setup(
    name="tensord",
    version=version(),
    packages=["tensord"],
    package_dir={"tensord": "tensord"},
    exclude_package_data={"tensord": ["*.c"]},
    ext_modules=[ext],
)
