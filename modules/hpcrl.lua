-- -*- lua -*-
-- Lmod modulefile for hpcrl (Slurm-first RL post-training of LLMs: Megatron trainer + SGLang engines).
--
-- Where hpcrl lives (HPCRL_HOME), first match wins:
--   1. $HPCRL_ROOT when set at load time (try a checkout without installing this file);
--   2. the folder above this file's modules/ folder when it holds the hpcrl package (hpcrl/__init__.py): a
--      source checkout (`module use /path/to/hpcrl/modules`), or /opt/hpcrl inside the hpcrl Apptainer image;
--   3. `site_root` below (site installs: copy this file to MODULEPATH/hpcrl/<version>.lua and edit it).
-- The hpcrl command comes from HPCRL_HOME/.venv/bin (what .ci/install makes), else HPCRL_HOME/venv/bin,
-- else HPCRL_HOME/bin (the image's layout). Loading fails with a message when that folder has no hpcrl.
-- Unloading uses the HPCRL_HOME the load set, so it undoes the load even if HPCRL_ROOT changed meanwhile.
-- Tested with real Lmod (Debian's lmod 8.6): tests/integration/test_modulefile.py.

local site_root = "/opt/hpcrl"

local function checkout_root()
    local here = myFileName()
    return here and here:match("^(.*)/modules/[^/]+$") or nil
end

local root = os.getenv("HPCRL_ROOT")
if mode() == "unload" and (os.getenv("HPCRL_HOME") or "") ~= "" then
    root = os.getenv("HPCRL_HOME")
end
if not root or root == "" then
    local co = checkout_root()
    if co and isFile(pathJoin(co, "hpcrl", "__init__.py")) then
        root = co
    else
        root = site_root
    end
end

local bin = pathJoin(root, "bin")
for _, venv in ipairs({".venv", "venv"}) do
    if isDir(pathJoin(root, venv, "bin")) then
        bin = pathJoin(root, venv, "bin")
        break
    end
end

whatis("Name: hpcrl")
whatis("Description: Slurm-first RL post-training of LLMs (GRPO and friends), no Ray")
whatis("URL: see HPCRL_HOME/README.md")

help([[
hpcrl: RL post-training of LLMs on Slurm (Megatron-core trainer, SGLang rollout engines, no Ray).

  hpcrl validate run.yaml                 check a config and print the resolved summary
  hpcrl submit run.yaml [key=value ...]   write the run folder and submit it (--dry-run: only write and print)
  hpcrl status | logs RUN [-f] | cancel RUN
  hpcrl run run.yaml                      run locally, without Slurm (the CPU quickstart)

This module puts the hpcrl command on PATH and sets HPCRL_HOME (the sbatch/ templates are found there).
For containers: slurm.container in the config runs every job step in `apptainer exec`; the image from
singularity/hpcrl.def has hpcrl in /opt/hpcrl, so `module load hpcrl` inside it finds the same layout.
]])

if mode() == "load" and not isFile(pathJoin(bin, "hpcrl")) then
    LmodError("hpcrl: no hpcrl command in " .. bin .. " (HPCRL_HOME=" .. root .. "). Set HPCRL_ROOT to the " ..
              "hpcrl install (the folder with .venv/bin, venv/bin or bin), or edit site_root in " ..
              (myFileName() or "the modulefile") .. ".")
end

pushenv("HPCRL_HOME", root)  -- pushenv: unloading restores a HPCRL_HOME set before (the image sets one)
prepend_path("PATH", bin)
