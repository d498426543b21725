package messagedata_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/messagedata"
)

func TestHeader_AbsentHeadersReadAsEmpty(t *testing.T) {
	var m messagedata.MessageData
	require.Equal(t, "", m.Header(messagedata.HeaderKey))

	m.Headers = map[string]string{messagedata.HeaderKey: "account-7"}
	require.Equal(t, "account-7", m.Header(messagedata.HeaderKey))
}
