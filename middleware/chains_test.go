package middleware_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/middleware"
)

func TestStages_EachLevelRefusesTheStagesItCannotHave(t *testing.T) {
	tx, dedup, inOrder := middleware.Recover(), middleware.Recover(), middleware.Recover()
	for _, c := range []struct {
		name  string
		level func(middleware.Stages) (middleware.Middleware, error)
		s     middleware.Stages
		err   string
	}{
		{"at-least-once without a transaction", middleware.AtLeastOnce, middleware.Stages{}, "Stages.Transaction: nil"},
		{"at-least-once with dedup", middleware.AtLeastOnce, middleware.Stages{Transaction: tx, Deduplicate: dedup}, "Stages.Deduplicate: set"},
		{"at-least-once in order", middleware.AtLeastOnce, middleware.Stages{Transaction: tx, InOrder: inOrder}, "Stages.InOrder: set"},
		{"exactly-once without a transaction", middleware.ExactlyOnce, middleware.Stages{Deduplicate: dedup}, "Stages.Transaction: nil"},
		{"exactly-once in order", middleware.ExactlyOnce, middleware.Stages{Transaction: tx, InOrder: inOrder}, "Stages.InOrder: set"},
		{"in order without a transaction", middleware.ExactlyOnceInOrder, middleware.Stages{InOrder: inOrder}, "Stages.Transaction: nil"},
		{"in order without in-order", middleware.ExactlyOnceInOrder, middleware.Stages{Transaction: tx, Deduplicate: dedup}, "Stages.InOrder: nil"},
	} {
		_, err := c.level(c.s)
		require.ErrorContains(t, err, c.err, c.name)
	}
	for _, level := range []func(middleware.Stages) (middleware.Middleware, error){middleware.AtLeastOnce, middleware.ExactlyOnce} {
		mw, err := level(middleware.Stages{Transaction: tx})
		require.NoError(t, err)
		require.NotNil(t, mw)
	}
}
