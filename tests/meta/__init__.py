"""Tests of shmstore/meta/, one file per module (a package: names may repeat those of other test folders)."""
