# Sourced ON the H200 device machine by the h200_*.sh scripts, from the repo root with `.gl` carried:
# the Vulkan loader debs unpacked into / (the device README's way), and the NVIDIA driver's ICD
# named where the machine has it, exported for everything started after.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
