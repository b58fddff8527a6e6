"""Tests of shmstore/node/, one file per module (a package: names may repeat those of other test folders)."""
