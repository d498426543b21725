package main

import (
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestVersion_PrintsTheModuleVersionAndGo(t *testing.T) {
	out, err := run(t, "version")
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(out, "onceflow "+version()+" "), out)
	require.Contains(t, out, runtime.Version())

	out, err = run(t, "--version")
	require.NoError(t, err)
	require.Equal(t, "onceflow "+version()+"\n", out)
}
