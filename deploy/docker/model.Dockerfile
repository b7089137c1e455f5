# syntax=docker/dockerfile:1
# A model image for the chart's model.source=image: the target and drafter folders under /models,
# on an image that has sh and cp (the chart's initContainer copies /models into the pods).
# Build with the folder holding both as the context, e.g. for the bundled tiny pair:
#   docker build -f deploy/docker/model.Dockerfile -t tandem-models:tiny models
ARG BASE_IMAGE=busybox:1.37
FROM ${BASE_IMAGE}
ARG TARGET=tiny-target
ARG DRAFTER=tiny-drafter
COPY ${TARGET} /models/${TARGET}
COPY ${DRAFTER} /models/${DRAFTER}
